"""The CURVE key file of an engine that listens on tcp:// for routers on
other machines (``kvstrata engine --credentials FILE``).

One JSON ``Credentials`` (``kvstrata.ipc.protocol``): the engine's server key
pair, the one client key pair it admits, and the owner token a Shutdown
must carry. Created on first use with mode 0600 (never readable by other
users: whoever holds it may use, and stop, the engine); copy it to the
routers' machines like an SSH key. A file that is readable by others or does
not decode is refused with an error naming it.
"""

from __future__ import annotations

import os
import stat

import msgspec

from kvstrata.ipc.protocol import Credentials


class KeyFileError(ValueError):
    """The key file is unsafe, unreadable or malformed (the message names it)."""


def load_or_create(path: str) -> Credentials:
    """The credentials in ``path``; a new CURVE set written there (0600) when absent."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load(path)
    except OSError as e:
        raise KeyFileError(f"credentials file {path}: cannot create it: {e}") from None
    creds = Credentials.new(curve=True)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(creds))
    return creds


def load(path: str) -> Credentials:
    """Read an existing key file (must be a regular file no other user can read)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise KeyFileError(f"credentials file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"credentials file {path}: not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(f"credentials file {path}: readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                           "chmod 600 it")
    try:
        with open(path, "rb") as f:
            creds = msgspec.json.decode(f.read(), type=Credentials)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise KeyFileError(f"credentials file {path}: not a kvstrata key file ({e})") from None
    if not creds.curve or creds.client_public is None:
        raise KeyFileError(f"credentials file {path}: has no CURVE keys")
    return creds
