"""The control plane, split along the ingress's route mixins: `ProfileControl` (profile routes),
`WeightControl` (weight routes), and what they share: the `Fleet` (broadcast, desired state, the
control lock) and the `StepRecords` (session records and manifests under save_path)."""
