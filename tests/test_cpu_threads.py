"""A CPU run on a loaded machine takes the cores the load leaves free (issue 54, item 6).

Torch's default of one thread per core made a tiny-config step 5-10x slower at load 6-15 on 2 cores
(the figures: docs/training.md). Only the choice is tested here, never a timing. Planted:
``cpu_threads`` ignoring the load (``cores``) -> the first two tests fail; OMP_NUM_THREADS not
honoured -> ``test_omp_num_threads_is_the_users_choice`` fails.
"""

import pytest
import torch

from data import cpu_threads as ct


@pytest.mark.parametrize(
    "cores, load, threads",
    [
        (2, 0.3, 2),  # an idle machine: torch's default
        (2, 1.4, 1),  # 0.6 of a core free: one thread
        (2, 6.0, 1),  # the load 6-15 on 2 cores: one thread, never zero
        (8, 2.2, 6),
        (8, 40.0, 1),
        (1, 0.0, 1),
    ],
)
def test_threads_are_the_cores_the_load_leaves(cores, load, threads):
    assert ct.cpu_threads(cores, load) == threads


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _machine(monkeypatch, cores: int, load: float) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ct, "available_cores", lambda: cores)
    monkeypatch.setattr(ct.os, "getloadavg", lambda: (load, load, load))


def test_a_loaded_cpu_gets_fewer_threads_and_says_so(monkeypatch, threads_kept):
    torch.set_num_threads(2)
    _machine(monkeypatch, cores=2, load=6.0)
    note = ct.set_cpu_threads()
    assert torch.get_num_threads() == 1
    assert note == (
        "cpu: 1 of 2 threads (load 6.0: busy cores slow every thread down); set OMP_NUM_THREADS to choose"
    )
    torch.set_num_threads(2)
    _machine(monkeypatch, cores=2, load=0.2)  # a free machine keeps torch's default, silently
    assert ct.set_cpu_threads() is None and torch.get_num_threads() == 2


def test_omp_num_threads_is_the_users_choice(monkeypatch, threads_kept):
    torch.set_num_threads(2)
    _machine(monkeypatch, cores=2, load=6.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ct.set_cpu_threads() is None and torch.get_num_threads() == 2
