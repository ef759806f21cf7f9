"""The WeightsService servicer: receives uploads into the store and reports push state."""

from __future__ import annotations

import structlog

from rlmesh.errors import InvalidArgument
from rlmesh.weights.v1 import weights_pb2, weights_pb2_grpc
from services.weights.pusher import Pusher
from services.weights.store import WeightStore

log = structlog.get_logger()


class WeightsServicer(weights_pb2_grpc.WeightsServiceServicer):
    def __init__(self, store: WeightStore, pusher: Pusher, backend_name: str) -> None:
        self.store = store
        self.pusher = pusher
        self.backend_name = backend_name

    async def UploadWeights(self, request_iterator, context):
        upload = None
        async for message in request_iterator:
            if upload is None:
                if not message.HasField("manifest"):
                    raise InvalidArgument("the first message of an upload must carry the manifest")
                upload = self.store.begin_upload(message.manifest)
            elif message.HasField("chunk"):
                upload.write(message.chunk.offset, message.chunk.data)
            else:
                raise InvalidArgument("only payload chunks may follow the manifest")
        if upload is None:
            raise InvalidArgument("the upload stream was empty")
        snapshot = self.store.finish(upload)
        log.info("version stored", weight_version=snapshot.version, bytes=snapshot.manifest.total_bytes)
        self.pusher.trigger()
        return weights_pb2.UploadWeightsResponse(version=snapshot.version, received_bytes=upload.received)

    async def GetStatus(self, request, context):
        latest = self.store.latest
        return weights_pb2.GetStatusResponse(
            latest_version=latest.version if latest else -1,
            latest_bytes=latest.manifest.total_bytes if latest else 0,
            backend=self.backend_name,
            instances=[
                weights_pb2.InstancePush(
                    instance_id=s.instance_id,
                    committed_version=s.committed_version,
                    pushing_version=s.pushing_version,
                    last_push_ms=s.last_push_ms,
                    last_push_gbps=s.last_push_gbps,
                    failures=s.failures,
                    last_error=s.last_error,
                )
                for s in self.pusher.instances.values()
            ],
        )
