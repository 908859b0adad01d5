"""`RepeatingLoader`: an endless iterator over a data loader, for loops counted in steps rather than epochs."""

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Iterate over `loader` forever, starting a new pass (a new `iter(loader)`) whenever one ends.

    Args:
        loader: any iterable that can be iterated more than once (a DataLoader, a list); one that yields
            nothing makes `next` raise StopIteration instead of looping.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
