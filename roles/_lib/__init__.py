"""What several roles share: batched facts, managed-file and unit operations, apt, reboots, distributions,
the template renderer and role settings. A role never imports another role's privates; it imports these."""
