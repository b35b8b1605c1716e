"""Ranks that die or disagree: the others exit with an error naming it, never hang.
And the torchrun path: the same command on every rank, rank 0 prints.

Each scenario runs in a subprocess with a deadline (the subprocess timeout is the
"never hangs" assertion; nothing waits on a clock otherwise).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers_models import write_tiny_hf_model

DEADLINE_S = 120
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("tpfail") / "tiny", seed=5)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=DEADLINE_S, cwd=REPO)


def test_a_rank_that_dies_ends_the_other_cleanly(tiny: Path) -> None:
    """Both ways, in one process (each is its own group): a worker killed mid-run fails
    rank 0's next step with an error, and rank 0 that ends without a word (os._exit: no
    STOP, no shutdown) leaves its worker, waiting for the next step, to see the closed
    connection and exit with status 1."""
    result = run_python("""
        import os, signal, sys
        from kvloom import LLM, SamplingParams
        llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", num_blocks=16)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.generate([[5, 6, 7]], params)  # the group works
        worker = llm.engine.first_rank.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        try:
            llm.generate([[5, 6, 7, 8]], params)
            sys.exit("the step did not fail")
        except RuntimeError as error:
            print("step failed:", str(error).splitlines()[0], flush=True)
            llm.shutdown()
        llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", num_blocks=16)
        print("worker", llm.engine.first_rank.processes[0].pid, flush=True)
        os._exit(0)
    """, str(tiny))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step failed:" in result.stdout
    pid = int(result.stdout.split("worker")[1].split()[0])
    # The daemonic worker is not reaped by its dead parent: wait on it through /proc.
    assert _exits_within(pid, DEADLINE_S), f"worker {pid} still running"


def _exits_within(pid: int, seconds: float) -> bool:
    """Block until ``pid`` is gone (``waitpid`` needs a child; a pidfd works for any)."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], seconds)
        return bool(readable)
    finally:
        os.close(fd)


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_torchrun_runs_the_same_command_on_every_rank(tiny: Path) -> None:
    flags = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "16", "--prompt", "hello there",
             "--max-tokens", "8"]
    single = subprocess.run([sys.executable, "-m", "kvloom", "generate", str(tiny), *flags],
                            capture_output=True, text=True, timeout=DEADLINE_S, cwd=REPO)
    assert single.returncode == 0, single.stderr[-2000:]
    result = torchrun("-m", "kvloom", "generate", str(tiny), "--tensor-parallel-size", "2", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == single.stdout  # rank 0 alone prints, the same text


def test_ranks_started_with_different_settings_fail_naming_the_difference(tiny: Path, tmp_path: Path) -> None:
    script = tmp_path / "mismatch.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from kvloom.cli import main
        block = "32" if os.environ["RANK"] == "1" else "16"
        sys.exit(main(["generate", sys.argv[1], "--tensor-parallel-size", "2", "--dtype", "float32",
                       "--device", "cpu", "--num-blocks", "16", "--block-size", block, "--prompt", "hi"]))
    """))
    result = torchrun(str(script), str(tiny))
    assert result.returncode != 0
    assert "rank 1 was started with a different block_size: 32, rank 0 has 16" in result.stderr


def test_tensor_parallel_size_must_match_the_ranks_torchrun_started(tiny: Path) -> None:
    result = torchrun("-m", "kvloom", "generate", str(tiny), "--tensor-parallel-size", "1", "--dtype",
                      "float32", "--device", "cpu", "--prompt", "hi")
    assert result.returncode != 0
    # Each rank refuses on its own; torchrun stops the others once the first has failed,
    # so which rank's message comes out first is a race.
    assert re.search(r"torchrun started this process as rank [01] of 2, but tensor_parallel_size is 1",
                     result.stderr), result.stderr[-2000:]


def test_a_script_without_a_main_guard_fails_at_once_naming_it(tiny: Path, tmp_path: Path) -> None:
    """spawn re-runs the script in each rank's process, where building the engine again
    fails before the rank's worker starts. Rank 0 waited out distributed_timeout (300 s,
    past this test's deadline) at the rendezvous, then raised torch's DistStoreError."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from kvloom import LLM
        LLM({str(tiny)!r}, tensor_parallel_size=2, dtype="float32", device="cpu", num_blocks=16)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=DEADLINE_S,
                            cwd=REPO)
    assert result.returncode != 0
    assert re.search(r"RankFailed: tensor-parallel rank 1 exited with status 1 before it started .*"
                     r'`if __name__ == "__main__":`', result.stderr), result.stderr[-2000:]
