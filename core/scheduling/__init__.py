"""Scheduling: the scheduler, admission and decode batches, retraction, output processing."""
