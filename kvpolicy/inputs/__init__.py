"""Inputs of the flow: the model and GPU catalogs, the workload, and the policy document."""
