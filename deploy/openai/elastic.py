"""The resize endpoints, vLLM's names: resize the cluster this front end serves, or ask whether
a resize runs.

    POST /scale_elastic_ep       {"new_data_parallel_size": M}: the report, once this front end
                                 routes over the new set (200); another resize runs (409); a
                                 size the model cannot be served at, or above what the Ray
                                 cluster holds or `--max-data-parallel-size` (400, before
                                 anything is created); rolled back (503)
    GET  /is_scaling_elastic_ep  {"is_scaling_elastic_ep": bool}

The resize runs on a worker thread of the front end's `AsyncLLM` (`shoal.cluster.elastic`), so
the event loop serves /v1 requests all along; requests on a leaving rank move to another.
"""

from __future__ import annotations

from http import HTTPStatus

from shoal.cluster.elastic import ScaleError, ScaleInProgressError
from shoal.deploy.openai.errors import OpenAIError, from_exception
from shoal.deploy.openai.protocol import (
    IsScalingElasticEPResponse,
    ScaleElasticEPRequest,
    ScaleElasticEPResponse,
)
from shoal.deploy.openai.state import ServerState
from shoal.deploy.scale import describe_failure


async def scale_elastic_ep(
    state: ServerState, request: ScaleElasticEPRequest
) -> ScaleElasticEPResponse:
    """Resizes the cluster to `request.new_data_parallel_size` ranks.

    Raises:
        OpenAIError: the resize was refused or failed (see `scale_failure`).
    """
    new_size, max_size = request.new_data_parallel_size, state.limits.max_data_parallel_size
    if max_size is not None and new_size > max_size:  # refused before any call to Ray
        raise OpenAIError(
            f"{new_size} ranks exceed this server's limit of {max_size} (--max-data-parallel-size)",
            param="new_data_parallel_size",
        )
    options: dict[str, object] = {"max_size": max_size}
    if request.switch_timeout_s is not None:
        options["switch_timeout_s"] = request.switch_timeout_s
    try:
        report = await state.llm.scale_elastic_ep(request.new_data_parallel_size, **options)
    except Exception as e:
        raise scale_failure(e) from e
    if report["outcome"] == "unchanged":
        message = f"the cluster has {report['to_size']} data parallel ranks already"
    else:
        message = f"scaled from {report['from_size']} to {report['to_size']} data parallel ranks"
    return ScaleElasticEPResponse(message=message, **report)


async def is_scaling_elastic_ep(state: ServerState) -> IsScalingElasticEPResponse:
    return IsScalingElasticEPResponse(is_scaling_elastic_ep=await state.llm.is_scaling_elastic_ep())


def scale_failure(e: BaseException) -> OpenAIError:
    """The error a refused or failed resize answers with."""
    message = describe_failure(e)
    if isinstance(e, ScaleInProgressError):
        return OpenAIError(message, HTTPStatus.CONFLICT, code="scale_in_progress")
    if isinstance(e, ScaleError):
        return OpenAIError(
            f"{message}; the cluster serves at its old size",
            HTTPStatus.SERVICE_UNAVAILABLE,
            code="scale_rolled_back",
        )
    if isinstance(e, ValueError):
        return OpenAIError(message, param="new_data_parallel_size")
    if isinstance(e, TimeoutError):  # after the commit: the cluster has its new size
        return OpenAIError(
            f"the resize committed, but this front end does not route over the new set yet: "
            f"{message}",
            HTTPStatus.GATEWAY_TIMEOUT,
            type="TimeoutError",
        )
    return from_exception(e)
