"""Files the grader touches that it does not trust: submissions and kernel work
directories. Only regular files are ever opened (``O_NOFOLLOW | O_NONBLOCK``, then
``fstat``): a symlink, FIFO, device or socket is named, never followed, read or hashed.
Walks use ``lstat`` and directory file descriptors, so no path is ever longer than one
name (nothing hides beyond ``PATH_MAX``), and removal needs neither recursion nor long
paths.
"""

from __future__ import annotations

import hashlib
import os
import stat

KINDS = (
    (stat.S_ISLNK, "符号链接"),
    (stat.S_ISFIFO, "FIFO（命名管道）"),
    (stat.S_ISSOCK, "套接字"),
    (stat.S_ISCHR, "字符设备"),
    (stat.S_ISBLK, "块设备"),
    (stat.S_ISDIR, "文件夹"),
)
MAX_NOTEBOOK = 64 * 2**20  # bytes: a larger "notebook" is refused, not read
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegular(OSError):
    """A path that is not a regular file (or is too large); the message says what."""


def kind(mode: int) -> str | None:
    """None for a regular file, else what it is (Chinese, for the feedback page)."""
    if stat.S_ISREG(mode):
        return None
    for test, name in KINDS:
        if test(mode):
            return name
    return "特殊文件"


def describe(path: str | os.PathLike) -> str | None:
    """None when ``path`` is a regular file; else what it is, a symlink with its
    target (read, never followed)."""
    st = os.lstat(path)
    what = kind(st.st_mode)
    if what and stat.S_ISLNK(st.st_mode):
        what += f"（指向 {os.readlink(path)}）"
    return what


def read_regular(path: str | os.PathLike, cap: int = MAX_NOTEBOOK) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``cap`` bytes; else
    :class:`NotRegular` naming what it is. Never follows a final symlink, never blocks
    on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == 40:  # ELOOP: the path is a symlink
            raise NotRegular(f"{os.fspath(path)} 是{describe(path)}，未读取") from None
        raise
    try:
        st = os.fstat(fd)
        what = kind(st.st_mode)
        if what:
            raise NotRegular(f"{os.fspath(path)} 是{what}，未读取")
        if st.st_size > cap:
            raise NotRegular(
                f"{os.fspath(path)} 有 {st.st_size} 字节，超过上限 {cap}，未读取"
            )
        chunks, left = [], cap + 1
        while left > 0:
            b = os.read(fd, min(left, 2**20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > cap:
            raise NotRegular(f"{os.fspath(path)} 超过上限 {cap} 字节，未读取")
        return data
    finally:
        os.close(fd)


def digest(path: str | os.PathLike) -> str:
    """sha256 of a regular file, or what the path is instead ("symlink → target",
    "FIFO", "unreadable: …")."""
    try:
        return hashlib.sha256(read_regular(path, 2**40)).hexdigest()
    except NotRegular as e:
        return f"not a regular file: {e}"
    except OSError as e:
        return f"unreadable: {e}"


def snapshot(root: str | os.PathLike) -> dict[str, str]:
    """relative path → :func:`digest` of everything under ``root`` (symlinked folders
    are listed as links, never entered)."""
    out = {}
    root = os.fspath(root)
    for dirpath, dirs, files in os.walk(root):  # followlinks=False
        for name in files + [
            d for d in dirs if os.path.islink(os.path.join(dirpath, d))
        ]:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = digest(p)
    return out


def dir_bytes(path: str, stop: int, max_depth: int = 200) -> tuple[int, str | None]:
    """(bytes allocated under ``path``, problem): the walk goes by directory file
    descriptors (no path-length limit), stops once past ``stop``, and reports a tree
    deeper than ``max_depth`` as a problem rather than leave it unmeasured."""
    total = 0
    try:
        top = os.open(path, DIR_FLAGS)
    except OSError:
        return 0, None
    stack = [(top, 0)]
    try:
        while stack:
            fd, depth = stack.pop()
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        total += st.st_blocks * 512
                        if stat.S_ISDIR(st.st_mode):
                            if depth + 1 > max_depth:
                                return total, f"文件夹嵌套超过 {max_depth} 层"
                            try:
                                stack.append(
                                    (os.open(e.name, DIR_FLAGS, dir_fd=fd), depth + 1)
                                )
                            except OSError as err:
                                if err.errno == 24:  # EMFILE: too many open folders
                                    return total, "工作目录里的文件夹太多"
                        if total > stop:
                            return total, None
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return total, None


def remove_tree(path: str) -> None:
    """Delete the folder ``path`` and everything in it, however deep: each folder's
    subfolders are moved up to ``path`` itself (renameat by descriptor) and its files
    unlinked, so at most two folders are open at a time and no path is longer than one
    name; folders left without permissions by their owner are opened again."""
    try:
        root = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return
    n = 0
    try:
        while True:
            names = os.listdir(root)
            if not names:
                break
            for name in names:
                st = os.stat(name, dir_fd=root, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=root)
                    continue
                if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
                    os.chmod(name, 0o700, dir_fd=root)
                d = os.open(name, DIR_FLAGS, dir_fd=root)
                try:
                    for child in os.listdir(d):
                        cst = os.stat(child, dir_fd=d, follow_symlinks=False)
                        if stat.S_ISDIR(cst.st_mode):
                            while True:
                                n += 1
                                new = f".rm-{n}"
                                try:
                                    os.stat(new, dir_fd=root, follow_symlinks=False)
                                except FileNotFoundError:
                                    break
                            os.rename(child, new, src_dir_fd=d, dst_dir_fd=root)
                        else:
                            os.unlink(child, dir_fd=d)
                finally:
                    os.close(d)
                os.rmdir(name, dir_fd=root)
    finally:
        os.close(root)
    os.rmdir(path)
