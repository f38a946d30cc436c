"""Fault-injection harness: workloads, fault injectors, the checker and the campaign."""
