"""What both engines share (lightning_pipe/lightning/engine.py)."""

import os

import torch

from lightning_pipe.lightning.engine import device_memory


def test_a_gpu_offers_what_is_free_and_what_this_process_already_holds(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 80 * gib))  # another process holds 50
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)  # this one's model and cache
    assert device_memory(torch.device("cuda", 1)) == 36 * gib


def test_the_cpu_offers_the_hosts_memory():
    assert device_memory(torch.device("cpu")) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
