"""A client of the service's HTTP API (httpx), as the CLI uses it."""

from __future__ import annotations

import base64
from typing import Any

import httpx

__all__ = ["Client", "ServiceError"]


class ServiceError(Exception):
    """The server refused a request (``status``, its reason) or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Client:
    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ServiceError(
                f"cannot reach the adaptrain server at {self.url} ({exc}); start one with "
                "`adaptrain server`, or point --server / ADAPTRAIN_SERVER at it"
            ) from None
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail")
            except ValueError:
                detail = resp.text
            if isinstance(detail, list):  # pydantic's validation errors
                detail = "; ".join(
                    f"{'.'.join(str(x) for x in d.get('loc', [])[1:])}: {d.get('msg')}"
                    for d in detail
                )
            raise ServiceError(f"{detail}", resp.status_code)
        return resp

    def submit(self, spec: dict[str, Any], workdir: bytes | None = None) -> dict[str, Any]:
        body = dict(spec)
        if workdir is not None:
            body["workdir"] = base64.b64encode(workdir).decode()
        return self._call("POST", "/jobs", json=body).json()

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/jobs").json()

    def job(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{name}").json()

    def delete(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/jobs/{name}").json()

    def logs(self, name: str, rank: int | None = None, offset: int = 0) -> tuple[bytes, int, bool]:
        params: dict[str, Any] = {"offset": offset}
        if rank is not None:
            params["rank"] = rank
        resp = self._call("GET", f"/jobs/{name}/logs", params=params)
        return resp.content, int(resp.headers["X-Next-Offset"]), resp.headers["X-Job-Done"] == "1"

    def file(self, name: str, path: str) -> bytes:
        return self._call("GET", f"/jobs/{name}/files/{path}").content

    def cluster(self) -> dict[str, Any]:
        return self._call("GET", "/cluster").json()
