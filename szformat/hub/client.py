"""How szformat talks to the Hub: its name and version for the user agent, and one-line reports of failed requests
for the command line."""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from typing import Iterator

from huggingface_hub import constants
from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

from ..errors import HubRequestError, first_line

TRANSPORT_ERRORS = (("requests", "RequestException"), ("httpx", "TransportError"), ("httpx2", "TransportError"))
"""Where the HTTP clients of huggingface_hub releases keep their connection errors (requests before 1.0, httpx
after); only the ones already imported are looked up."""


def library_info() -> dict[str, str]:
    """Keyword arguments naming szformat and its version, for ``HfApi``, ``hf_hub_download``, ``snapshot_download``."""
    from .. import __version__  # the package root imports this package: read the version at call time

    return {"library_name": "szformat", "library_version": __version__}


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn a refused Hub request or a failed connection into `HubRequestError`, whose message fits on one line.

    huggingface_hub's messages span several lines (status, URL, a documentation link, the server's message) and a
    connection error surfaces as the HTTP client's own exception: the command line prints neither as it is.
    """
    try:
        yield
    except HfHubHTTPError as e:
        raise HubRequestError(describe_http_error(e)) from e
    except _transport_errors() as e:
        if _answered(e):  # huggingface_hub 0.x re-raises some refusals as requests' own HTTPError
            raise HubRequestError(describe_http_error(e)) from e
        raise HubRequestError(_unreachable(e)) from e
    except LocalEntryNotFoundError as e:  # a download that found neither the Hub nor a cached copy
        if isinstance(e.__cause__, _transport_errors()):
            raise HubRequestError(_unreachable(e.__cause__)) from e
        raise HubRequestError(" ".join(str(e).split())) from e


def describe_http_error(error: BaseException) -> str:
    """``the Hub refused the request (403 Forbidden): You don't have the rights to write to bob/x``."""
    response = getattr(error, "response", None)
    reason = getattr(response, "reason_phrase", None) or getattr(response, "reason", None)  # httpx, requests
    status = " ".join(str(part) for part in (getattr(response, "status_code", None), reason) if part)
    message = (getattr(error, "server_message", None) or getattr(error.__cause__, "server_message", None)
               or first_line(error))  # the cause: huggingface_hub 0.x re-raises some with its own words
    return f"the Hub refused the request{f' ({status})' if status else ''}: {' '.join(message.split())}"


def _answered(error: BaseException) -> bool:
    """Whether the Hub answered the request that raised ``error`` (with a status code): a refusal, not a failed
    connection."""
    return getattr(getattr(error, "response", None), "status_code", None) is not None


_OS_ERROR = re.compile(r"\[Errno -?\d+\] [^'\"()\\]+")


def _unreachable(error: BaseException) -> str:
    """``cannot reach the Hub at URL: [Errno 111] Connection refused``: the operating system's reason where the
    HTTP client's message holds one (requests nests it in the reprs of two exceptions), else that message."""
    found = _OS_ERROR.search(str(error))
    return f"cannot reach the Hub at {constants.ENDPOINT}: {found.group().strip() if found else error}"


def _transport_errors() -> tuple[type[BaseException], ...]:
    return tuple(getattr(sys.modules[module], name) for module, name in TRANSPORT_ERRORS if module in sys.modules)
