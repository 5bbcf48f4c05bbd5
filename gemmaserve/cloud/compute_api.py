"""What `gemmaserve capacity` reads from compute.googleapis.com v1 about a GPU VM, over the discovery client."""

from __future__ import annotations

from typing import Protocol

from gemmaserve.cloud.tpu_api import ApiError, api_error, discovery_service

__all__ = ["ApiError", "ComputeApi", "GoogleComputeApi"]


class ComputeApi(Protocol):
    def get_instance(self, project: str, zone: str, name: str) -> dict: ...


class GoogleComputeApi:
    """instances.get, with the same credentials as the gcp provider (gcp_credentials.credentials_for)."""

    def __init__(self, credentials=None, endpoint: str | None = None):
        self._instances = discovery_service("compute", "v1", credentials, endpoint).instances()

    def get_instance(self, project: str, zone: str, name: str) -> dict:
        from googleapiclient.errors import HttpError

        try:
            return self._instances.get(project=project, zone=zone, instance=name).execute(num_retries=3)
        except HttpError as error:
            raise api_error(error) from None
