"""The proof harness of outbox-migrate: throwaway servers (`testing`) and the live-load
simulation (`sim`) that `demo`, `rehearse`, the test suite and bench/ run. A distribution of its
own, pinned to the outbox-migrate release it drives, so a production install ships none of it."""
