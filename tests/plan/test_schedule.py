from lightning_pipe.plan.schedule import clock_cycles


def test_clock_cycles_cover_every_task_once_in_dependency_order():
    ticks = list(clock_cycles(4, 3))
    assert len(ticks) == 4 + 3 - 1
    tasks = [task for tick in ticks for task in tick]
    assert sorted(tasks) == [(i, j) for i in range(4) for j in range(3)]
    when = {task: k for k, tick in enumerate(ticks) for task in tick}
    for i in range(4):
        for j in range(1, 3):
            assert when[(i, j)] == when[(i, j - 1)] + 1  # a stage runs right after its input
    assert ticks[2] == [(2, 0), (1, 1), (0, 2)]


def test_clock_cycles_more_stages_than_microbatches():
    ticks = list(clock_cycles(1, 3))
    assert ticks == [[(0, 0)], [(0, 1)], [(0, 2)]]
