"""Rotating JSONL files with a byte cap: where a server records its teacher's answers as `onepass tune` rows.

``Records(folder, max_bytes, file_bytes)`` appends whole lines to ``teacher-<UTC time>-<n>.jsonl``; a file is
closed once the next line would take it past ``file_bytes`` and a new one begun; once the folder's files
would hold more than ``max_bytes``, the oldest are deleted (the newest answers are kept). A line is written
in one call and flushed; if the write fails (a full disk), the file is cut back to its last whole line, so
every file holds only whole rows that `onepass tune --data` reads as they are.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from .errors import OnepassError

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
        self._file, self._size, self._seq = None, 0, 0
        self.rows = self.deleted = self.failed = 0

    def files(self) -> list[Path]:
        """The folder's record files, oldest first."""
        return sorted(p for p in self.folder.glob(f"{PREFIX}*{SUFFIX}") if p.is_file())

    def write(self, line: bytes) -> bool:
        """Append one whole line (it must end in a newline and fit a file); False (counted) if it could not be."""
        if not line.endswith(b"\n") or len(line) > self.file_bytes:
            self.failed += 1
            return False
        with self._lock:
            try:
                if self._file is None or self._size + len(line) > self.file_bytes:
                    self._rotate()
                self._file.write(line)
                self._file.flush()
                self._size += len(line)
                self.rows += 1
                return True
            except OSError:
                self.failed += 1
                self._cut_back()
                return False

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        self._seq += 1
        path = self.folder / f"{PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{self._seq:06d}{SUFFIX}"
        files = self.files()
        total = sum(p.stat().st_size for p in files)
        while files and total + self.file_bytes > self.max_bytes:  # room for a whole new file: the oldest go first
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink(missing_ok=True)
            self.deleted += 1
        self._file, self._size = open(path, "ab"), 0

    def _cut_back(self) -> None:
        """After a failed write: the file back to its last whole line."""
        if self._file is None:
            return
        try:
            self._file.truncate(self._size)
            self._file.seek(self._size)
        except (OSError, ValueError):
            self._file = None  # a new file next time

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
