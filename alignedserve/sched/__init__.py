"""Scheduling policies (aligned, fcfs, static) over ``Request`` and ``KVStore``; pure Python."""
