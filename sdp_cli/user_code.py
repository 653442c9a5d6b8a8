"""Your code, named in a config value: ``package.module:function`` or ``path/to/file.py:function``.

Rewards (``task.reward``) and correction modes (``loss.mode``) are loaded the same way: the
module is imported before a run writes anything, and every failure is one line that names the
config key, the file and the line (a syntax error, an import that fails, a missing function).
A file is imported once per version (path, size, modification time): an edited file is imported
afresh, never a stale copy. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from sdp_cli.errors import UserError


def is_code_spec(value: str) -> bool:
    """Whether a config value names code (``module:function`` or ``file.py:function``) rather
    than a built-in name; a URL is not code."""
    return ":" in value and not value.startswith(("http:", "https:"))


def file_target(spec: str) -> Path | None:
    """The file of a ``path/to/file.py:function`` spec (None for other forms)."""
    target = spec.rpartition(":")[0]
    if not is_code_spec(spec) or not (target.endswith(".py") or "/" in target or "\\" in target):
        return None
    return Path(target).expanduser()


def canonical(spec: str) -> str:
    """The spec with an absolute file path: the same from any working directory or worker."""
    path = file_target(spec)
    return spec if path is None else f"{path.resolve()}:{spec.rpartition(':')[2]}"


def where_in(exc: BaseException, path: Path | None) -> str:
    """``file:line`` of the deepest traceback frame in ``path`` (or the deepest frame at all)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if path is not None:
        inside = [f for f in frames if Path(f.filename).resolve() == path.resolve()]
        frames = inside or frames
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else str(path or "")


def _import_file(path: Path, setting: str, prefix: str) -> Any:
    if not path.is_file():
        raise UserError(f"{setting}: {path} does not exist; give path/to/file.py:function")
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:12]
    name = f"{prefix}_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None, f"no import spec for {path}"
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and process pools look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[name]
        raise UserError(f"{err.filename}:{err.lineno}: SyntaxError: {err.msg} ({setting}); fix the file") from None
    except Exception as err:
        del sys.modules[name]
        raise UserError(f"{where_in(err, path)}: {type(err).__name__}: {err} while importing {setting}; fix the file") from None
    return module


def _import_module(module_name: str, setting: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise UserError(
                f"{setting}: no module {err.name!r} on the Python path; install it, add its directory to "
                "PYTHONPATH, or give a file: path/to/file.py:function"
            ) from None
        raise UserError(f"{where_in(err, None)}: {err} while importing {setting}; fix the import") from None
    except SyntaxError as err:
        raise UserError(f"{err.filename}:{err.lineno}: SyntaxError: {err.msg} ({setting}); fix the file") from None
    except Exception as err:
        raise UserError(f"{where_in(err, None)}: {type(err).__name__}: {err} while importing {setting}; fix the module") from None


def load_function(spec: str, key: str, *, module_prefix: str = "sdp_user") -> tuple[Callable[..., Any], str]:
    """(function, display name ``file.py:function`` or ``module:function``) named by ``spec``,
    the value of config key ``key``; a one-line UserError otherwise."""
    setting = f"{key}={spec}"
    target, _, attr = spec.rpartition(":")
    if not target or not attr.isidentifier():
        raise UserError(f"{setting}: expected package.module:function or path/to/file.py:function")
    path = file_target(spec)
    module = _import_file(path, setting, module_prefix) if path is not None else _import_module(target, setting)
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        near = difflib.get_close_matches(attr, defined, n=1)
        hint = f"did you mean {near[0]}?" if near else f"it defines {', '.join(defined) or 'no functions'}"
        raise UserError(f"{setting}: {target} has no function {attr!r}; {hint}")
    if not callable(fn):
        raise UserError(f"{setting}: {target}.{attr} is a {type(fn).__name__}, not a function")
    return fn, f"{path.name if path is not None else target}:{attr}"
