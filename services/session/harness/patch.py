"""The ``apply_patch`` tool: the Codex CLI's patch format, parsed here and
applied through the environment port (read, write and remove).

The format::

    *** Begin Patch
    *** Add File: PATH          then every line of the new file, each prefixed by "+"
    *** Delete File: PATH
    *** Update File: PATH
    *** Move to: NEW_PATH       optional, right after Update File
    @@ [a line of the file to find first, e.g. "def greet():"]
     context line               (a space, then the line)
    -removed line
    +added line
    *** End of File             optional: the hunk ends at the end of the file
    *** End Patch

An update has one or more hunks, each opened by ``@@`` (the first may omit
it). A hunk's context and removed lines are found in the file after the
previous hunk, first exactly, then ignoring trailing whitespace, then
ignoring surrounding whitespace. Paths are relative to /workspace (or
absolute under it).

All or nothing: every file is read and every hunk is matched in memory
before anything is written, so a patch that does not apply changes
nothing. Should a write itself fail midway (the sandbox became unreachable,
the disk is full), the files already written are restored best effort.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.core.errors import BerthError, NotFound
from services.core.workspace_limits import path_limit_problem
from services.session.harness.environment import EnvironmentPort, model_fault

__all__ = [
    "PatchError",
    "AddFile",
    "DeleteFile",
    "UpdateFile",
    "Hunk",
    "parse_patch",
    "apply_hunks",
    "apply_patch",
    "PatchResult",
    "MAX_PATCH_FILE_BYTES",
]

WORKSPACE = "/workspace"
# The largest file a patch may update or delete (it is read whole).
MAX_PATCH_FILE_BYTES = 8 * 1024 * 1024

_BEGIN = "*** Begin Patch"
_END = "*** End Patch"
_ADD = "*** Add File: "
_DELETE = "*** Delete File: "
_UPDATE = "*** Update File: "
_MOVE = "*** Move to: "
_END_OF_FILE = "*** End of File"


class PatchError(Exception):
    """The patch is malformed or does not apply; the message is for the model."""


@dataclass(frozen=True)
class AddFile:
    path: str
    content: str


@dataclass(frozen=True)
class DeleteFile:
    path: str


@dataclass(frozen=True)
class Hunk:
    # The line after "@@ ", to find before the hunk's lines; None for a bare "@@".
    anchor: str | None
    old: list[str]
    new: list[str]
    end_of_file: bool = False


@dataclass(frozen=True)
class UpdateFile:
    path: str
    move_to: str | None
    hunks: list[Hunk]


FileOp = AddFile | DeleteFile | UpdateFile


# ----------------------------------------------------------------- parsing


def parse_patch(text: str) -> list[FileOp]:
    """The patch's file operations, in order; PatchError names the first bad line."""
    lines = text.strip().splitlines()
    if not lines or lines[0].strip() != _BEGIN:
        raise PatchError(f"the first line of the patch must be '{_BEGIN}'")
    if len(lines) < 2 or lines[-1].strip() != _END:
        raise PatchError(f"the last line of the patch must be '{_END}'")
    body = lines[1:-1]
    ops: list[FileOp] = []
    i = 0
    while i < len(body):
        line = body[i]
        number = i + 2
        if line.startswith(_ADD):
            path = _header_path(line, _ADD, number)
            i += 1
            content: list[str] = []
            while i < len(body) and not body[i].startswith("*** "):
                if not body[i].startswith("+"):
                    raise PatchError(f"line {i + 2}: every line of an added file must start with '+'")
                content.append(body[i][1:])
                i += 1
            ops.append(AddFile(path, "".join(f"{c}\n" for c in content)))
        elif line.startswith(_DELETE):
            ops.append(DeleteFile(_header_path(line, _DELETE, number)))
            i += 1
        elif line.startswith(_UPDATE):
            path = _header_path(line, _UPDATE, number)
            i += 1
            move_to = None
            if i < len(body) and body[i].startswith(_MOVE):
                move_to = _header_path(body[i], _MOVE, i + 2)
                i += 1
            hunks, i = _parse_hunks(body, i)
            if not hunks:
                raise PatchError(f"line {number}: the update of {path} has no hunks")
            ops.append(UpdateFile(path, move_to, hunks))
        elif not line.strip():
            i += 1
        else:
            raise PatchError(
                f"line {number}: expected '{_ADD}', '{_DELETE}' or '{_UPDATE}' followed by a path, got {line!r}"
            )
    if not ops:
        raise PatchError("the patch changes no file")
    return ops


def _header_path(line: str, prefix: str, number: int) -> str:
    path = line[len(prefix) :].strip()
    if not path:
        raise PatchError(f"line {number}: '{prefix.strip()}' needs a path")
    return path


def _parse_hunks(body: list[str], i: int) -> tuple[list[Hunk], int]:
    hunks: list[Hunk] = []
    while i < len(body) and not body[i].startswith("*** "):
        line = body[i]
        anchor: str | None = None
        if line.startswith("@@"):
            anchor = line[2:].strip() or None
            i += 1
        elif hunks:
            raise PatchError(f"line {i + 2}: expected '@@' to open the next hunk, got {line!r}")
        old: list[str] = []
        new: list[str] = []
        end_of_file = False
        while i < len(body):
            line = body[i]
            if line.startswith("@@") or (line.startswith("*** ") and line.strip() != _END_OF_FILE):
                break
            if line.strip() == _END_OF_FILE:
                end_of_file = True
                i += 1
                break
            if line.startswith(" ") or line == "":
                old.append(line[1:])
                new.append(line[1:])
            elif line.startswith("-"):
                old.append(line[1:])
            elif line.startswith("+"):
                new.append(line[1:])
            else:
                raise PatchError(f"line {i + 2}: a hunk line must start with ' ', '-' or '+', got {line!r}")
            i += 1
        if not old and not new:
            raise PatchError(f"line {i + 1}: a hunk has no lines")
        hunks.append(Hunk(anchor, old, new, end_of_file))
    return hunks, i


# ----------------------------------------------------------------- matching


def _find(lines: Sequence[str], pattern: Sequence[str], start: int, *, at_end: bool) -> int | None:
    """Where ``pattern`` starts in ``lines`` at or after ``start``: exact
    first, then ignoring trailing whitespace, then surrounding whitespace."""
    if not pattern:
        return len(lines) if at_end else start
    last = len(lines) - len(pattern)
    if last < start:
        return None
    candidates = [last] if at_end else range(start, last + 1)
    for normalize in (lambda s: s, str.rstrip, str.strip):
        wanted = [normalize(p) for p in pattern]
        for index in candidates:
            if all(normalize(lines[index + k]) == wanted[k] for k in range(len(pattern))):
                return index
    return None


def apply_hunks(path: str, original: str, hunks: Sequence[Hunk]) -> str:
    """The file's new text, or PatchError naming the hunk that did not match."""
    lines = original.split("\n")
    if lines and lines[-1] == "":
        # The final newline ends the last line; it is not an empty line of its own.
        lines.pop()
    replacements: list[tuple[int, int, list[str]]] = []
    cursor = 0
    for number, hunk in enumerate(hunks, start=1):
        if hunk.anchor is not None:
            found = _find(lines, [hunk.anchor], cursor, at_end=False)
            if found is None:
                raise PatchError(f"{path}: hunk {number}: could not find the line {hunk.anchor!r}")
            cursor = found + 1
        old, new = hunk.old, hunk.new
        if not old:
            # Only added lines: after the anchor when there is one, else at the end.
            at_insert = cursor if hunk.anchor is not None else len(lines)
            replacements.append((at_insert, 0, list(new)))
            continue
        at = _find(lines, old, cursor, at_end=hunk.end_of_file)
        if at is None and old and old[-1] == "":
            # A trailing empty context line may stand for the final newline.
            old = old[:-1]
            new = new[:-1] if new and new[-1] == "" else new
            at = _find(lines, old, cursor, at_end=hunk.end_of_file)
        if at is None:
            shown = "\n".join(hunk.old[:8])
            raise PatchError(f"{path}: hunk {number}: could not find these lines:\n{shown}")
        replacements.append((at, len(old), list(new)))
        cursor = at + len(old)
    replacements.sort(key=lambda r: r[0])
    for at, length, new in reversed(replacements):
        lines[at : at + length] = new
    return "".join(f"{line}\n" for line in lines)


# ----------------------------------------------------------------- applying


def workspace_path(path: str) -> str:
    """The absolute path under /workspace that ``path`` names, or PatchError."""
    if "\x00" in path:
        raise PatchError(f"{path!r}: a path cannot contain NUL")
    full = posixpath.normpath(path if path.startswith("/") else posixpath.join(WORKSPACE, path))
    if full == WORKSPACE or not full.startswith(WORKSPACE + "/"):
        raise PatchError(f"{path}: paths must name a file under {WORKSPACE}")
    problem = path_limit_problem(full)
    if problem is not None:
        raise PatchError(f"{path}: a path {problem}")
    return full


@dataclass
class PatchResult:
    """What an applied patch changed: (letter, path) pairs, A added, M
    modified, D deleted; a move is D of the old path and A or M of the new."""

    changes: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        return "Success. Updated the following files:\n" + "\n".join(f"{k} {p}" for k, p in self.changes)


class _Files:
    """The patch's view of the workspace: originals as read, and the new
    state every operation so far leads to."""

    def __init__(self, env: EnvironmentPort) -> None:
        self._env = env
        self.original: dict[str, bytes | None] = {}
        self.current: dict[str, str | None] = {}
        # Existing files that are not UTF-8 text: they can be deleted or replaced, not updated.
        self.binary: set[str] = set()

    async def _load(self, path: str) -> None:
        if path in self.original:
            return
        try:
            data, truncated = await self._env.read_file(path, limit=MAX_PATCH_FILE_BYTES)
        except NotFound:
            self.original[path] = None
            self.current[path] = None
            return
        except BerthError as exc:
            if not model_fault(exc):
                raise
            raise PatchError(f"{path}: {exc.message}") from exc
        if truncated:
            raise PatchError(f"{path}: larger than {MAX_PATCH_FILE_BYTES} bytes, too large to patch")
        self.original[path] = data
        try:
            self.current[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            self.current[path] = None
            self.binary.add(path)

    async def exists(self, path: str) -> bool:
        await self._load(path)
        return self.current[path] is not None or path in self.binary

    async def text(self, path: str, shown: str) -> str:
        await self._load(path)
        text = self.current[path]
        if text is None:
            raise PatchError(f"{shown}: " + ("not UTF-8 text" if path in self.binary else "no such file"))
        return text

    async def put(self, path: str, text: str | None) -> None:
        await self._load(path)
        self.current[path] = text
        self.binary.discard(path)


async def apply_patch(env: EnvironmentPort, text: str) -> PatchResult:
    """Parses and applies the patch. PatchError (nothing changed) is for the
    model, and so is a read the sandbox refused (``model_fault``); any other
    error of the port propagates, after the files already written are
    restored."""
    ops = parse_patch(text)
    files = _Files(env)
    result = PatchResult()
    for op in ops:
        path = workspace_path(op.path)
        if isinstance(op, AddFile):
            await files.put(path, op.content)
            result.changes.append(("A", op.path))
        elif isinstance(op, DeleteFile):
            if not await files.exists(path):
                raise PatchError(f"{op.path}: no such file")
            await files.put(path, None)
            result.changes.append(("D", op.path))
        else:
            new_text = apply_hunks(op.path, await files.text(path, op.path), op.hunks)
            if op.move_to is not None:
                target = workspace_path(op.move_to)
                await files.put(path, None)
                existed = await files.exists(target)
                await files.put(target, new_text)
                result.changes.append(("D", op.path))
                result.changes.append(("M" if existed else "A", op.move_to))
            else:
                await files.put(path, new_text)
                result.changes.append(("M", op.path))
    await _commit(env, files)
    return result


async def _commit(env: EnvironmentPort, files: _Files) -> None:
    done: list[str] = []
    try:
        for path, text in files.current.items():
            if path in files.binary:
                continue  # read, never changed
            before = files.original[path]
            if text is None:
                if before is not None:
                    await env.remove_file(path)
                    done.append(path)
            elif before is None or before != text.encode():
                await env.write_file(path, text.encode())
                done.append(path)
    except Exception:
        # Not on cancellation: a cancelled turn does not undo side effects.
        await _restore(env, files, done)
        raise


async def _restore(env: EnvironmentPort, files: _Files, done: list[str]) -> None:
    for path in reversed(done):
        before = files.original[path]
        try:
            if before is None:
                await env.remove_file(path)
            else:
                await env.write_file(path, before)
        except (BerthError, OSError):
            # Best effort: the sandbox that failed the write may fail this too.
            continue
