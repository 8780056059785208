import torch

from lightning_pipe.runtime.dependency import fork, join


def _reaches(node, target) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(f for f, _ in n.next_functions)
    return False


def test_join_makes_the_forked_backward_wait_for_it():
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    earlier = b * 2
    assert not _reaches((a * 3).grad_fn, earlier.grad_fn)
    forked, phony = fork(earlier)
    later = join(a * 3, phony)
    # The forked node is now a dependency of the joined one: autograd cannot run its
    # backward until the joined branch's backward has reached the join.
    assert _reaches(later.grad_fn, forked.grad_fn)
    assert phony.numel() == 0
    (forked.sum() + later.sum()).backward()
    assert a.grad.tolist() == [3, 3] and b.grad.tolist() == [2, 2]


def test_values_pass_through_unchanged():
    x = torch.randn(3, requires_grad=True)
    y, phony = fork(x)
    w = torch.randn(3)
    assert torch.equal(y, x) and torch.equal(join(w, phony), w)
