"""kvloom.lang: programs of prompts, ``gen``, ``select`` and ``fork`` that share the
radix cache (in the spirit of SGLang's frontend language).

    import kvloom.lang as kl

    @kl.function
    def triage(s, ticket):
        s += kl.system("You sort support tickets.")
        s += kl.user(ticket)
        s += kl.assistant(kl.select("team", ["billing", "bugs", "sales"]))

    kl.set_default_backend(kl.Local(LLM()))   # or kl.Endpoint("http://127.0.0.1:8000")
    print(triage.run(ticket="I was charged twice.")["team"])
"""

from kvloom.lang.backend import Backend, Local
from kvloom.lang.endpoint import Endpoint
from kvloom.lang.errors import LangError
from kvloom.lang.expr import assistant, gen, select, system, user
from kvloom.lang.program import Function, function, set_default_backend
from kvloom.lang.state import ProgramState

__all__ = ["Backend", "Endpoint", "Function", "LangError", "Local", "ProgramState", "assistant", "function",
           "gen", "select", "set_default_backend", "system", "user"]
