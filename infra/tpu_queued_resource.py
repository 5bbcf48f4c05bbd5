"""The TPU queued-resource provider's old name: it lives in gemmaserve.cloud.tpu_queued_resource.

Stacks deployed before the move hold the provider pickled by reference as
`tpu_queued_resource.QueuedResourceProvider`, and Pulumi reads and deletes a dynamic resource with the provider
stored in its state; the provider server runs in infra/ (Pulumi.yaml `main`), where this name resolves to the
same class. Keep it until no stack's state names it (`pulumi up` stores the new reference)."""

from gemmaserve.cloud.tpu_queued_resource import QueuedResourceProvider, TpuQueuedResource

__all__ = ["QueuedResourceProvider", "TpuQueuedResource"]
