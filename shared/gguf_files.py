"""Where a model given as GGUF (llama.cpp's single-file checkpoint) lies: a ``.gguf`` file, or
a directory that holds exactly one. Torch-free: the gateway and the engine both ask."""

from pathlib import Path

SUFFIX = ".gguf"


def gguf_path(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names, or None when it is not a GGUF model (a Hugging Face
    checkpoint directory). A directory with several ``.gguf`` files is ambiguous: refused."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix == SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob(f"*{SUFFIX}"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise ValueError(f"{path} holds several GGUF files ({names}): name one of them")
    return found[0] if found else None


def default_model_name(model: str | Path) -> str:
    """The name a model is served under when none is given: a checkpoint directory's name, or
    a GGUF file's without its suffix."""
    path = Path(model)
    return path.stem if path.suffix == SUFFIX else path.name
