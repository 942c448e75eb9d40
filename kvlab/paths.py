"""Where the workbook's shipped files live (one definition for every module)."""

import errno
import json
import math
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data"
PRESETS_DIR = DATA_DIR / "presets"  # model configs and gpus.json
RESULTS_DIR = DATA_DIR / "results"  # precomputed sweeps and benchmark results
MODEL_DIR = DATA_DIR / "model"  # kvlab-tiny, the unit-test model
CORPUS_DIR = DATA_DIR / "corpus"


def shown_path(path: str | Path, limit: int = 120) -> str:
    """``path`` as an error line quotes it: a 4,000-character path keeps its two ends and says how long it was."""
    # a newline or an escape sequence in a name would break the one-line message or drive the terminal: escape it
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(path))
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]}...{text[-half:]} ({len(text):,} characters)"


def _special(absolute: str) -> bool:
    """A path under /dev or /proc: devices and process streams (/dev/shm, a plain tmpfs, is not one)."""
    parts = Path(absolute).parts
    return parts[1:2] == ("proc",) or (parts[1:2] == ("dev",) and parts[2:3] != ("shm",))


def result_path(path: str | Path) -> Path:
    """Where a result for ``path`` is written: a symbolic link's target (a rename onto the link would replace the
    link itself and leave the file it points to untouched), else ``path``."""
    return Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)


def out_problem(path: str | Path, flag: str = "--out") -> str | None:
    """Why ``path`` cannot take a result file (checked before a long run, not after it), or None.

    Refused: a directory, a missing folder, anything that exists but is not a regular file (a device
    such as /dev/null would be replaced by the atomic rename), a path under /dev or /proc (``/dev/stdout`` is a
    link to a stream, which a rename cannot write into), and a file or folder we may not write. A symbolic link
    to a file is followed: the result replaces the file it points to (:func:`result_path`), not the link.
    """
    if not str(path).strip():
        return f"{flag} is empty"
    if str(path).endswith(("/", "/.", "/..")) or str(path) in (".", ".."):
        return f"{flag} {shown_path(path)}: names a folder, not a file"
    try:
        return _out_problem(path, flag)
    except OSError as e:  # a name too long, a folder we may not search: one line, not a traceback
        return f"{flag} {shown_path(path)}: {(e.strerror or str(e)).lower()}"


def _out_problem(path: str | Path, flag: str) -> str | None:
    if Path(path).is_symlink() and not Path(path).exists():
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"{flag} {shown_path(path)}: is a loop of symbolic links"
    if any(_special(x) for x in (os.path.abspath(path), os.path.realpath(path))):
        return (f"{flag} {shown_path(path)}: is a device or a process's stream, not a regular file (a result is written to a "
                f"temporary file and renamed into place; give a file path)")
    out = result_path(path)
    if out.is_dir():
        return f"{flag} {shown_path(path)}: is a directory"
    if not out.parent.is_dir():
        what = ("is not a folder" if out.parent.exists() else
                "is a symbolic link that leads nowhere (or a loop)" if out.parent.is_symlink() else "does not exist")
        return f"{flag} {shown_path(path)}: '{shown_path(out.parent)}' {what}"
    if out.exists() and not out.is_file():
        return f"{flag} {shown_path(path)}: exists and is not a regular file"
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        return f"{flag} {shown_path(path)}: is not writable"
    try:  # access() says yes to root everywhere (/proc included): create a file there to be sure
        fd, probe = tempfile.mkstemp(dir=out.parent, suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{flag} {shown_path(path)}: cannot create a file in '{shown_path(out.parent)}' ({e.strerror or e})"
    return None


def folder_problem(path: str | Path, flag: str = "--out") -> str | None:
    """Why ``path`` cannot take result files named by the run (a script writing ``<gpu>_<date>.json`` into it), or
    None: checked before the run, as :func:`out_problem` checks a file."""
    if not str(path).strip():
        return f"{flag} is empty"
    try:
        os.stat(path)
    except OSError as e:
        what = ("is a loop of symbolic links" if e.errno == errno.ELOOP else "no such folder"
                if e.errno in (errno.ENOENT, errno.ENOTDIR) else (e.strerror or str(e)).lower())
        return f"{flag} {shown_path(path)}: {what}"
    if not Path(path).is_dir():
        return f"{flag} {shown_path(path)}: is not a folder"
    if any(_special(x) for x in (os.path.abspath(path), os.path.realpath(path))):
        return f"{flag} {shown_path(path)}: is a folder of devices or process streams; give a folder for results"
    try:  # access() says yes to root everywhere: create a file there to be sure
        fd, probe = tempfile.mkstemp(dir=path, suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{flag} {shown_path(path)}: cannot create a file there ({(e.strerror or str(e)).lower()})"
    return None


MAX_TEXT_BYTES = 64 * 2**20  # a haystack or corpus file: far more than a 32k-token prompt needs


def read_text(path: str | Path, flag: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file given on the command line, or ``ValueError`` naming ``flag``: a regular file (a device
    or a pipe never ends), at most ``max_bytes``, not empty."""
    p = Path(path)
    if str(path).endswith(("/", "/.")):  # Path() drops a trailing slash: "notes.txt/" would read notes.txt
        raise ValueError(f"{flag} {shown_path(path)}: names a folder (it ends in /), not a file")
    if any(_special(x) for x in (os.path.abspath(path), os.path.realpath(path))):
        raise ValueError(f"{flag} {shown_path(path)}: is under /proc or /dev: a process's or a device's stream, not a "
                         "regular file")
    if p.is_dir():
        raise ValueError(f"{flag} {shown_path(path)}: is a folder, not a file")
    if not p.is_file():
        raise ValueError(f"{flag} {shown_path(path)}: " + ("is not a regular file (a device or a pipe has no end to read to)"
                                               if p.exists() else "no such file"))
    size = p.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{flag} {shown_path(path)}: {size:,} bytes, more than the {max_bytes:,} this reads")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {shown_path(path)}: cannot read it as UTF-8 text ({e})") from None
    if not text.strip():
        raise ValueError(f"{flag} {shown_path(path)}: the file is empty")
    return text


def parse_json(text: str, what: str):
    """Strict JSON (no NaN or Infinity, which no result of ours holds), or ``ValueError`` starting with ``what``."""
    def no_constant(name):
        raise ValueError(f"holds {name}, which strict JSON has not")
    def finite(token):  # 1e999 parses to inf, which strict JSON cannot hold either
        x = float(token)
        if not math.isfinite(x):
            raise ValueError(f"holds {token}, a number past a float's range")
        return x
    try:
        return json.loads(text, parse_constant=no_constant, parse_float=finite)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not JSON ({e.msg}, line {e.lineno})") from None
    except (ValueError, RecursionError) as e:  # a constant above, a 5,000-digit integer, nesting too deep to read
        why = ("nested too deeply" if isinstance(e, RecursionError) else str(e) if str(e).startswith("holds ")
               else "a number too long to read")
        raise ValueError(f"{what}: {why}") from None


def load_json(path: str | Path, what: str, max_bytes: int = MAX_TEXT_BYTES) -> dict:
    """A JSON object from a file, read as :func:`read_text` reads (a regular file, at most ``max_bytes``) and parsed
    strictly; every error is a ``ValueError`` naming ``what`` and the file."""
    doc = parse_json(read_text(path, what, max_bytes), f"{what} {shown_path(path)}")
    if not isinstance(doc, dict):
        raise ValueError(f"{what} {shown_path(path)}: holds a JSON {type(doc).__name__}, not an object")
    return doc


def read_json(path: str | Path, flag: str, shape: dict[str, type]) -> dict:
    """A JSON result file a script resumes from, or ``ValueError`` naming ``flag``: read as :func:`read_text`
    reads, a JSON object, and each key of ``shape`` that it holds of that type (a file some other program
    wrote is refused, not half-resumed)."""
    text = read_text(path, flag)
    try:
        doc = parse_json(text, f"{flag} {shown_path(path)}")
    except ValueError as e:
        msg = str(e)
        if ": not JSON (" in msg:
            raise ValueError(f"{msg}; move it away") from None
        head, _, why = msg.rpartition(": ")
        raise ValueError(f"{head}: not a result this script wrote ({why}); move it away") from None
    wrong = [k for k, t in shape.items() if k in doc and not isinstance(doc[k], t)] if isinstance(doc, dict) else None
    if wrong is None or wrong:
        raise ValueError(f"{flag} {shown_path(path)}: not a result this script wrote"
                         + (f" ({', '.join(wrong)} of the wrong type)" if wrong else "") + "; move it away")
    return doc


class WriteError(OSError, ValueError):
    """A result file could not be written (disk full, quota, permissions changed during the run, the path turned
    into a folder or lost its folder): callers keep the result elsewhere (stdout) and say so."""


def write_json(path: str | Path, doc) -> None:
    """Write ``doc`` as JSON to ``path`` atomically (a temporary file in the same folder, then a rename),
    so an interrupted run never leaves a half-written result. :class:`WriteError` (also a ``ValueError``) when the
    path cannot take it, checked again here since a long run can outlive the check made before it."""
    if why := out_problem(path, "path"):  # never rename over a device or into a folder that is not there
        raise WriteError(why)
    path = result_path(path)
    text = json.dumps(doc, indent=1, allow_nan=False) + "\n"  # strict JSON: a NaN is a bug, named here
    try:  # the mode a plain open() would give: the old file's, else what the umask allows (mkstemp makes 0600)
        mode = path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a quota: say which file, in one line (callers keep the result elsewhere)
        Path(tmp).unlink(missing_ok=True)
        raise WriteError(f"{shown_path(path)}: could not write it ({e.strerror or e})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
