"""The daemon's listening socket, made without the ``socket`` module (a
daemon that starts dormant binds it before anything heavier is imported).

The socket is bound under a temporary name and renamed into place once it
listens, so the socket file existing means a daemon accepts connections
there: the host can wait for that without connecting (which would wake a
dormant daemon).
"""

from __future__ import annotations

import _socket
import os
import stat


def bind_unix_socket(path: str) -> int:
    """A listening, non-blocking unix socket at ``path`` (0600); returns
    its descriptor (not inheritable)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    name = os.path.basename(path)
    temporary = ".%s.%d" % (name, os.getpid())
    # sun_path holds about 108 bytes, so the bind goes through a short
    # /proc/self/fd alias of the directory.
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        try:
            os.unlink(temporary, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        sock.bind("/proc/self/fd/%d/%s" % (dir_fd, temporary))
        sock.listen(128)
        sock.setblocking(False)
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
        os.close(dir_fd)
    return sock.detach()
