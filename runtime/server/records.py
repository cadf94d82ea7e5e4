"""Rotating JSONL files with a byte cap: where a server records its teacher's answers as `onepass tune` rows.

``Records(folder, max_bytes, file_bytes)`` appends whole lines to ``teacher-<UTC time>-<n>.jsonl``; a file is
closed once the next line would take it past ``file_bytes`` and a new one begun; once the folder's files
would hold more than ``max_bytes``, the oldest are deleted (the newest answers are kept). A line is written
with unbuffered writes to the file (``os.write``, looping on partial writes); if a write fails (a full disk, a
file size limit), the file is cut back to its last whole line and closed, so every file holds only whole rows
that `onepass tune --data` reads as they are.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ..core.errors import OnepassError

PREFIX, SUFFIX = "teacher-", ".jsonl"


class Records:
    """Thread-safe append-only recorder of JSONL lines (``write(line_bytes)``)."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int = 1 << 30, file_bytes: int = 64 << 20):
        if file_bytes < 1024 or max_bytes < file_bytes:
            raise OnepassError(f"record caps: a file must allow >= 1 KiB and the folder at least one file "
                               f"(file {file_bytes} B, folder {max_bytes} B)")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OnepassError(f"cannot create the record folder {self.folder}: {err.strerror}") from None
        if not os.access(self.folder, os.W_OK):
            raise OnepassError(f"the record folder {self.folder} is not writable")
        self.max_bytes, self.file_bytes = max_bytes, file_bytes
        self._lock = threading.Lock()
        self._fd, self._size, self._seq, self._closed = None, 0, 0, False
        self.rows = self.deleted = self.failed = 0

    def files(self) -> list[Path]:
        """The folder's record files, oldest first."""
        return sorted(p for p in self.folder.glob(f"{PREFIX}*{SUFFIX}") if p.is_file())

    def write(self, line: bytes) -> bool:
        """Append one whole line (it must end in a newline and fit a file); False (counted) if it could not be."""
        with self._lock:
            if self._closed or not line.endswith(b"\n") or len(line) > self.file_bytes:
                self.failed += 1
                return False
            try:
                if self._fd is None or self._size + len(line) > self.file_bytes:
                    self._rotate()
                view = memoryview(line)
                while view:
                    view = view[os.write(self._fd, view):]
                self._size += len(line)
                self.rows += 1
                return True
            except OSError:
                self.failed += 1
                self._cut_back()
                return False

    def _rotate(self) -> None:
        self._close_file()
        self._seq += 1
        path = self.folder / f"{PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{self._seq:06d}{SUFFIX}"
        files = self.files()
        total = sum(p.stat().st_size for p in files)
        while files and total + self.file_bytes > self.max_bytes:  # room for a whole new file: the oldest go first
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink(missing_ok=True)
            self.deleted += 1
        self._fd, self._size = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 0

    def _cut_back(self) -> None:
        """After a failed write: the file back to its last whole line, and closed (the next write starts a file)."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
        self._close_file()

    def _close_file(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None

    def close(self) -> None:
        """Close the current file; later writes are refused (counted as failed)."""
        with self._lock:
            self._closed = True
            self._close_file()
