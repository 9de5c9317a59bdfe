"""Loading untrusted ``torch.save`` files (released checkpoints, DeepSpeed states) without ever
executing pickled code: weights-only first, then an unpickler that resolves an allow-list only."""

from __future__ import annotations

import collections
import mmap
import pickle
import tarfile
import types
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .paths import regular_file


class _Stub:
    """Inert stand-in for anything a checkpoint names outside the allow-list (DeepSpeed's argparse
    args, numpy RNG state, or a payload's ``os.system``): constructing it stores nothing and runs
    nothing, so a pickled call to it is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any,
                    *ignored: Any) -> torch.Tensor:
    """What ``torch._utils._rebuild_tensor(_v2)`` does for plain tensors, with public calls only.

    ``requires_grad``, backward hooks and metadata in the file are ignored: loaded weights are
    data, never hooks that would run later."""
    if not isinstance(storage, torch.TypedStorage):
        raise pickle.UnpicklingError("a tensor's data is not a torch storage")
    return torch.empty((0,), dtype=storage.dtype, device=storage.device).set_(
        storage.untyped(), int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, *ignored: Any) -> torch.Tensor:
    """``nn.Parameter`` pickles: the tensor only (no hooks, no attributes set from the file)."""
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError("a parameter's data is not a tensor")
    return data


def _latin1_bytes(text: Any, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """Protocol 2 pickles ``bytes`` as ``_codecs.encode(text, 'latin1')``; only that is allowed."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError("_codecs.encode is only allowed for latin1 bytes")
    return text.encode("latin1")


def _allowed_globals() -> dict[str, Any]:
    """Every global a legacy or zip ``torch.save`` of a state dict needs, and nothing else.

    Storage classes (``torch.FloatStorage``...) never reach this table: torch's own loader maps
    every ``*Storage`` name to a storage type before asking the unpickler."""
    allowed: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.bytearray": bytearray,
        "_codecs.encode": _latin1_bytes,
        "torch.Size": torch.Size,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    }
    allowed.update({f"torch.{name}": value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    return allowed


def _restricted_pickle_module(stubbed: list[str]) -> Any:
    """A stand-in for the ``pickle`` module, for ``torch.load(pickle_module=...)``.

    Its unpickler resolves only :func:`_allowed_globals` (our wrappers, never torch's private
    functions themselves); every other global becomes :class:`_Stub` and its name is appended to
    ``stubbed``. ``load`` (which torch's legacy loader calls for the file's header records) uses
    the same unpickler: a pickle is never read by the unrestricted ``pickle.load``."""
    allowed = _allowed_globals()

    def resolve(module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key in allowed:
            return allowed[key]
        stubbed.append(key)
        return _Stub

    unpickler = restricted_unpickler(resolve)

    def load(file: Any, **kwargs: Any) -> Any:
        return unpickler(file, **kwargs).load()

    return types.SimpleNamespace(Unpickler=unpickler, load=load,
                                 __name__="tokenformer_restricted_pickle")


def restricted_unpickler(resolve: Callable[[str, str], Any]) -> type[pickle.Unpickler]:
    """An unpickler that obtains every global (``GLOBAL``, ``STACK_GLOBAL``, ``EXT*``) from
    ``resolve(module, name)`` only, never by importing: the only callables a pickle can then
    reach are the ones ``resolve`` hands out (or it raises ``pickle.UnpicklingError``)."""
    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return resolve(module, name)

    return Unpickler


def _refused_container(path: Path) -> str | None:
    """Why ``torch.load(weights_only=False)`` must not see this file at all, if it must not.

    Such a load would hand a TorchScript archive to ``torch.jit.load`` and a legacy tar archive
    to ``tarfile``; neither goes through the restricted unpickler. A TorchScript zip is spotted by
    the name ``constants.pkl`` anywhere in the raw bytes (zip member names are stored as is), so a
    zip parser that disagrees with torch's cannot hide it."""
    with path.open("rb") as f:
        head = f.read(4)
        if head == b"PK\x03\x04" and path.stat().st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(b"constants.pkl") != -1:
                    return "a TorchScript archive (code, not weights)"
            return None
    if tarfile.is_tarfile(path):
        return "a pre-2018 tar checkpoint (not supported)"
    return None


def _unreadable(path: Path, detail: str = "truncated or corrupt?",
                stubbed: Sequence[str] = ()) -> CheckpointError:
    names = sorted(set(stubbed))
    note = (f"; it names {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}, "
            f"which was not run" if names else "")
    return CheckpointError(f"{path} is not a readable PyTorch checkpoint ({detail}){note}")


def safe_torch_load(path: str | Path, *, foreign: bool = True) -> Any:
    """Load a ``torch.save`` file (zip or legacy format) without ever executing pickled code.

    First ``torch.load(weights_only=True)``. With ``foreign`` (released checkpoints: DeepSpeed's
    ``mp_rank_00_model_states.pt`` also pickles its argparse namespace), a file that load refuses
    is read again through :func:`_restricted_pickle_module`: tensors and plain containers are
    rebuilt, every other object becomes an inert :class:`_Stub`, nothing named in the file is
    called. ``foreign=False`` (our own files) allows the ``weights_only`` load only.
    """
    path = regular_file(path, "checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pickle-protocol and source-change notes: not the user's
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # refused globals, zip errors, EOF, bad magic: decided below
            if not foreign:
                raise _unreadable(path, "truncated, corrupt, or not plain tensors") from None
        refused = _refused_container(path)
        if refused is not None:
            raise CheckpointError(f"{path} is {refused}; refusing to load it") from None
        stubbed: list[str] = []
        try:
            return torch.load(path, map_location="cpu", weights_only=False,
                              pickle_module=_restricted_pickle_module(stubbed))
        except Exception:
            raise _unreadable(path, stubbed=stubbed) from None
