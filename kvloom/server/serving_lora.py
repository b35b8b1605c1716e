"""POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter: vLLM's, behind its switch
for updating adapters at run time (``--allow-runtime-lora-updating``, or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Loading checks the adapter on the engine thread
(the engine refuses one it could not serve, naming why) and makes its name a model
clients may name; unloading takes the name away (requests in flight on it finish)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvloom.server.errors import APIError, bad_request
from kvloom.server.generation import Serving
from kvloom.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def install_lora_updating(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        info = serving.model_info()
        name = body.lora_name
        if name in serving.settings.model_ids(info.model_name):
            raise bad_request(f"{name!r} is the served model's name, not an adapter's", "lora_name")
        if name in serving.loras:
            raise bad_request(f"The LoRA adapter {name!r} has already been loaded.", "lora_name")
        try:
            lora = serving.loras.add(name, body.lora_path)  # the name is taken while the engine checks it
        except ValueError as error:
            raise bad_request(str(error), "lora_path") from None
        try:
            await serving.engine.call(lambda engine: engine.add_lora(lora))
        except ValueError as error:
            serving.loras.remove(name)
            raise bad_request(str(error), "lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        serving.model_info()
        name = body.lora_name
        if not serving.loras.remove(name):
            raise APIError(404, f"The LoRA adapter {name!r} cannot be found.", param="lora_name",
                           code="lora_not_found")
        await serving.engine.call(lambda engine: engine.remove_lora(name))
        return f"Success: LoRA adapter '{name}' removed successfully."
