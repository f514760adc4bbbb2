"""Policy codes of the compiled cache kernel (:func:`moelab.caches._fast.replay`).

Kept apart from :mod:`moelab.caches._fast` so that the policy classes can name their kernel
(``ExpertCache.kernel``) without importing numba.
"""

LRU, FIFO, LFU, MRS, STATIC, BELADY = 0, 1, 2, 3, 4, 5

#: Insertion rules as the kernel's ints (``moelab.caches.base.INSERTIONS`` order).
INSERTION_CODES: dict[str, int] = {"always": 0, "protect-step": 1}
