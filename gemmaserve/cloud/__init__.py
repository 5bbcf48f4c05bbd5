"""What the Pulumi program (infra/) and `gemmaserve capacity` share: the stack's cloud config, Google Cloud's TPU
and Compute REST adapters, the gcp provider's credentials and the TPU queued-resource provider and its rules.
Importable from any installed gemmaserve (the `infra` extra brings their libraries), so nothing edits sys.path."""
