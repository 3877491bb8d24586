from otel_dra._generated.k8s import meta_pb2 as _meta_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResourceClaim(_message.Message):
    __slots__ = ("metadata", "spec", "status")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    metadata: _meta_pb2.DetailedObjectMeta
    spec: ResourceClaimSpec
    status: ResourceClaimStatus
    def __init__(self, metadata: _Optional[_Union[_meta_pb2.DetailedObjectMeta, _Mapping]] = ..., spec: _Optional[_Union[ResourceClaimSpec, _Mapping]] = ..., status: _Optional[_Union[ResourceClaimStatus, _Mapping]] = ...) -> None: ...

class ResourceClaimSpec(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: DeviceClaim
    def __init__(self, devices: _Optional[_Union[DeviceClaim, _Mapping]] = ...) -> None: ...

class DeviceClaim(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DeviceRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DeviceRequest, _Mapping]]] = ...) -> None: ...

class DeviceRequest(_message.Message):
    __slots__ = ("name", "exactly", "firstAvailable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXACTLY_FIELD_NUMBER: _ClassVar[int]
    FIRSTAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    exactly: ExactDeviceRequest
    firstAvailable: _containers.RepeatedCompositeFieldContainer[DeviceSubRequest]
    def __init__(self, name: _Optional[str] = ..., exactly: _Optional[_Union[ExactDeviceRequest, _Mapping]] = ..., firstAvailable: _Optional[_Iterable[_Union[DeviceSubRequest, _Mapping]]] = ...) -> None: ...

class ExactDeviceRequest(_message.Message):
    __slots__ = ("deviceClassName",)
    DEVICECLASSNAME_FIELD_NUMBER: _ClassVar[int]
    deviceClassName: str
    def __init__(self, deviceClassName: _Optional[str] = ...) -> None: ...

class DeviceSubRequest(_message.Message):
    __slots__ = ("name", "deviceClassName")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICECLASSNAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    deviceClassName: str
    def __init__(self, name: _Optional[str] = ..., deviceClassName: _Optional[str] = ...) -> None: ...

class ResourceClaimStatus(_message.Message):
    __slots__ = ("allocation", "reservedFor", "devices")
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    RESERVEDFOR_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    allocation: AllocationResult
    reservedFor: _containers.RepeatedCompositeFieldContainer[ResourceClaimConsumerReference]
    devices: _containers.RepeatedCompositeFieldContainer[AllocatedDeviceStatus]
    def __init__(self, allocation: _Optional[_Union[AllocationResult, _Mapping]] = ..., reservedFor: _Optional[_Iterable[_Union[ResourceClaimConsumerReference, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[AllocatedDeviceStatus, _Mapping]]] = ...) -> None: ...

class AllocationResult(_message.Message):
    __slots__ = ("devices", "allocationTimestamp")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONTIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    devices: DeviceAllocationResult
    allocationTimestamp: _meta_pb2.Time
    def __init__(self, devices: _Optional[_Union[DeviceAllocationResult, _Mapping]] = ..., allocationTimestamp: _Optional[_Union[_meta_pb2.Time, _Mapping]] = ...) -> None: ...

class DeviceAllocationResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DeviceRequestAllocationResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DeviceRequestAllocationResult, _Mapping]]] = ...) -> None: ...

class DeviceRequestAllocationResult(_message.Message):
    __slots__ = ("request", "driver", "pool", "device", "adminAccess", "bindingConditions", "bindingFailureConditions", "shareID", "consumedCapacity", "skipNodeOperations")
    class ConsumedCapacityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _meta_pb2.Quantity
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_meta_pb2.Quantity, _Mapping]] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADMINACCESS_FIELD_NUMBER: _ClassVar[int]
    BINDINGCONDITIONS_FIELD_NUMBER: _ClassVar[int]
    BINDINGFAILURECONDITIONS_FIELD_NUMBER: _ClassVar[int]
    SHAREID_FIELD_NUMBER: _ClassVar[int]
    CONSUMEDCAPACITY_FIELD_NUMBER: _ClassVar[int]
    SKIPNODEOPERATIONS_FIELD_NUMBER: _ClassVar[int]
    request: str
    driver: str
    pool: str
    device: str
    adminAccess: bool
    bindingConditions: _containers.RepeatedScalarFieldContainer[str]
    bindingFailureConditions: _containers.RepeatedScalarFieldContainer[str]
    shareID: str
    consumedCapacity: _containers.MessageMap[str, _meta_pb2.Quantity]
    skipNodeOperations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request: _Optional[str] = ..., driver: _Optional[str] = ..., pool: _Optional[str] = ..., device: _Optional[str] = ..., adminAccess: _Optional[bool] = ..., bindingConditions: _Optional[_Iterable[str]] = ..., bindingFailureConditions: _Optional[_Iterable[str]] = ..., shareID: _Optional[str] = ..., consumedCapacity: _Optional[_Mapping[str, _meta_pb2.Quantity]] = ..., skipNodeOperations: _Optional[_Iterable[str]] = ...) -> None: ...

class ResourceClaimConsumerReference(_message.Message):
    __slots__ = ("apiGroup", "resource", "name", "uid")
    APIGROUP_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    apiGroup: str
    resource: str
    name: str
    uid: str
    def __init__(self, apiGroup: _Optional[str] = ..., resource: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class AllocatedDeviceStatus(_message.Message):
    __slots__ = ("driver", "pool", "device", "conditions", "shareID")
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    SHAREID_FIELD_NUMBER: _ClassVar[int]
    driver: str
    pool: str
    device: str
    conditions: _containers.RepeatedCompositeFieldContainer[_meta_pb2.Condition]
    shareID: str
    def __init__(self, driver: _Optional[str] = ..., pool: _Optional[str] = ..., device: _Optional[str] = ..., conditions: _Optional[_Iterable[_Union[_meta_pb2.Condition, _Mapping]]] = ..., shareID: _Optional[str] = ...) -> None: ...
