"""kvlab.env: where a measurement ran, as the shipped results record it."""

import os

from kvlab.env import cpu_model, machine


def test_machine_names_the_processor_cores_and_torch_threads_when_given():
    assert machine() == machine(None) and machine().endswith(f"{os.cpu_count()} cores") and cpu_model() in machine()
    assert machine(2) == machine() + ", torch 2 threads"
