from otel_dra._generated.k8s import meta_pb2 as _meta_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pod(_message.Message):
    __slots__ = ("metadata", "spec", "status")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    metadata: _meta_pb2.ObjectMeta
    spec: PodSpec
    status: PodStatus
    def __init__(self, metadata: _Optional[_Union[_meta_pb2.ObjectMeta, _Mapping]] = ..., spec: _Optional[_Union[PodSpec, _Mapping]] = ..., status: _Optional[_Union[PodStatus, _Mapping]] = ...) -> None: ...

class PodSpec(_message.Message):
    __slots__ = ("nodeName", "resourceClaims")
    NODENAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCECLAIMS_FIELD_NUMBER: _ClassVar[int]
    nodeName: str
    resourceClaims: _containers.RepeatedCompositeFieldContainer[PodResourceClaim]
    def __init__(self, nodeName: _Optional[str] = ..., resourceClaims: _Optional[_Iterable[_Union[PodResourceClaim, _Mapping]]] = ...) -> None: ...

class PodResourceClaim(_message.Message):
    __slots__ = ("name", "resourceClaimName", "resourceClaimTemplateName")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCECLAIMNAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCECLAIMTEMPLATENAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    resourceClaimName: str
    resourceClaimTemplateName: str
    def __init__(self, name: _Optional[str] = ..., resourceClaimName: _Optional[str] = ..., resourceClaimTemplateName: _Optional[str] = ...) -> None: ...

class PodStatus(_message.Message):
    __slots__ = ("conditions", "containerStatuses", "initContainerStatuses", "resourceClaimStatuses")
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERSTATUSES_FIELD_NUMBER: _ClassVar[int]
    INITCONTAINERSTATUSES_FIELD_NUMBER: _ClassVar[int]
    RESOURCECLAIMSTATUSES_FIELD_NUMBER: _ClassVar[int]
    conditions: _containers.RepeatedCompositeFieldContainer[PodCondition]
    containerStatuses: _containers.RepeatedCompositeFieldContainer[ContainerStatus]
    initContainerStatuses: _containers.RepeatedCompositeFieldContainer[ContainerStatus]
    resourceClaimStatuses: _containers.RepeatedCompositeFieldContainer[PodResourceClaimStatus]
    def __init__(self, conditions: _Optional[_Iterable[_Union[PodCondition, _Mapping]]] = ..., containerStatuses: _Optional[_Iterable[_Union[ContainerStatus, _Mapping]]] = ..., initContainerStatuses: _Optional[_Iterable[_Union[ContainerStatus, _Mapping]]] = ..., resourceClaimStatuses: _Optional[_Iterable[_Union[PodResourceClaimStatus, _Mapping]]] = ...) -> None: ...

class PodCondition(_message.Message):
    __slots__ = ("type", "status", "lastTransitionTime")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LASTTRANSITIONTIME_FIELD_NUMBER: _ClassVar[int]
    type: str
    status: str
    lastTransitionTime: _meta_pb2.Time
    def __init__(self, type: _Optional[str] = ..., status: _Optional[str] = ..., lastTransitionTime: _Optional[_Union[_meta_pb2.Time, _Mapping]] = ...) -> None: ...

class PodResourceClaimStatus(_message.Message):
    __slots__ = ("name", "resourceClaimName")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCECLAIMNAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    resourceClaimName: str
    def __init__(self, name: _Optional[str] = ..., resourceClaimName: _Optional[str] = ...) -> None: ...

class ContainerStatus(_message.Message):
    __slots__ = ("name", "state", "allocatedResourcesStatus")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATEDRESOURCESSTATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ContainerState
    allocatedResourcesStatus: _containers.RepeatedCompositeFieldContainer[ResourceStatus]
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ContainerState, _Mapping]] = ..., allocatedResourcesStatus: _Optional[_Iterable[_Union[ResourceStatus, _Mapping]]] = ...) -> None: ...

class ContainerState(_message.Message):
    __slots__ = ("running", "terminated")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    running: ContainerStateRunning
    terminated: ContainerStateTerminated
    def __init__(self, running: _Optional[_Union[ContainerStateRunning, _Mapping]] = ..., terminated: _Optional[_Union[ContainerStateTerminated, _Mapping]] = ...) -> None: ...

class ContainerStateRunning(_message.Message):
    __slots__ = ("startedAt",)
    STARTEDAT_FIELD_NUMBER: _ClassVar[int]
    startedAt: _meta_pb2.Time
    def __init__(self, startedAt: _Optional[_Union[_meta_pb2.Time, _Mapping]] = ...) -> None: ...

class ContainerStateTerminated(_message.Message):
    __slots__ = ("startedAt",)
    STARTEDAT_FIELD_NUMBER: _ClassVar[int]
    startedAt: _meta_pb2.Time
    def __init__(self, startedAt: _Optional[_Union[_meta_pb2.Time, _Mapping]] = ...) -> None: ...

class ResourceStatus(_message.Message):
    __slots__ = ("name", "resources")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    name: str
    resources: _containers.RepeatedCompositeFieldContainer[ResourceHealth]
    def __init__(self, name: _Optional[str] = ..., resources: _Optional[_Iterable[_Union[ResourceHealth, _Mapping]]] = ...) -> None: ...

class ResourceHealth(_message.Message):
    __slots__ = ("resourceID", "health")
    RESOURCEID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    resourceID: str
    health: str
    def __init__(self, resourceID: _Optional[str] = ..., health: _Optional[str] = ...) -> None: ...
