"""How a reward's weights load: a transformers folder or hub id (:func:`load_or_explain`), the checkpoint file a
folder or hub repo holds (:func:`checkpoint_path`) and its tensors (:func:`load_state_dict_file`).

Every in-process reward loads through these, so a load that fails names the reward, what it was loading and
where: a missing folder or hub id (``ValueError``), and a file that exists but does not read (random bytes, a
truncated download: :func:`unreadable_checkpoint`, an :class:`~unirl_pl.errors.InputError`), instead of the
library's own message (safetensors' ``header too large`` names neither the reward nor the file).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from unirl_pl.errors import InputError

T = TypeVar("T")


def corrupt_weights(path: str | os.PathLike) -> Path | None:
    """The first ``*.safetensors`` file at ``path`` (a file, or a local folder's files) whose header does not read;
    None when every one reads, or ``path`` is not local (a hub id)."""
    from safetensors import safe_open

    local = Path(path).expanduser()
    files = [local] if local.is_file() else sorted(local.glob("*.safetensors")) if local.is_dir() else []
    for file in files:
        if file.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception:  # whatever safetensors says, the file does not read
            return file
    return None


def unreadable_checkpoint(reward: str, what: str, path: str | os.PathLike, err: BaseException) -> InputError:
    """The one-line error for a checkpoint file that exists but does not read (random bytes, a truncated download,
    a pickle where weights belong): the reward, what it was loading and the file (or the folder it is in)."""
    file = corrupt_weights(path) or path
    detail = " ".join(str(err).split()) or type(err).__name__
    return InputError(
        f"reward {reward!r}: its {what} {str(file)!r} is corrupt or not a checkpoint ({detail}); download it again"
    )


def load_or_explain(reward: str, what: str, path: str, load: Callable[[], T]) -> T:
    """``load()``, or a ValueError naming the reward, what it was loading and from where.

    transformers raises OSError for a missing folder, a hub id that is not cached offline and a folder
    without the expected files; the reward's name is what a user needs to find the recipe line at fault.
    A weights file that does not read (safetensors' ``SafetensorError``: random bytes, a truncated download) is
    named with :func:`unreadable_checkpoint`.
    """
    from safetensors import SafetensorError

    try:
        return load()
    except SafetensorError as err:
        raise unreadable_checkpoint(reward, what, path, err) from err
    except (OSError, ValueError) as err:
        offline = " (HF_HUB_OFFLINE is set: a hub id must already be in the local cache)"
        hint = offline if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"reward {reward!r}: cannot load its {what} from {path!r}: {detail}. Give a local folder or a hub id{hint}"
        ) from err


def checkpoint_path(reward: str, pretrained_path: str, checkpoint_file: str, where: str) -> str:
    """The weights file a reward loads: ``pretrained_path`` itself when it is a file; ``checkpoint_file`` inside
    it when it is a folder (or a path that looks local: absolute, ``.`` or ``~``), which must exist; else
    ``checkpoint_file`` of the hub repo it names (from the cache when offline). ``where`` says where to get it."""
    path = Path(pretrained_path).expanduser()
    if path.is_file():
        return str(path)
    if path.is_dir() or path.is_absolute() or pretrained_path.startswith((".", "~")):
        file = path / checkpoint_file if path.is_dir() else path
        if not file.is_file():
            raise ValueError(
                f"reward {reward!r}: its checkpoint {str(file)!r} is not a file; it is {where}. Download it and "
                "set pretrained_path to the file or its folder (or to the hub id when it is in the cache)"
            )
        return str(file)
    from huggingface_hub import hf_hub_download

    return load_or_explain(
        reward,
        f"checkpoint {checkpoint_file!r} (pretrained_path; {where})",
        pretrained_path,
        lambda: hf_hub_download(pretrained_path, checkpoint_file),
    )


def load_state_dict_file(reward: str, what: str, path: str) -> dict[str, Tensor]:
    """Tensors from a ``.safetensors`` file or a torch checkpoint (``.pt``/``.pth``, loaded weights-only);
    a checkpoint that wraps them in ``state_dict`` is unwrapped and a DDP ``module.`` prefix dropped. Every
    reward's checkpoint file loads here (HPSv2, HPSv3, ImageReward, the aesthetic MLP): one that does not read
    is an :class:`~unirl_pl.errors.InputError` naming the reward and the file."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"reward {reward!r}: its {what} {path!r} is not a file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as err:  # random bytes, a truncated download, a pickle with code in it: not a checkpoint
        raise unreadable_checkpoint(reward, what, file, err) from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"reward {reward!r}: its {what} {path!r} is not a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}
