"""The composition root: builds a node's pieces and hands them to the bridge (`dtrain-node`)."""
import os

# numpy's OpenBLAS keeps worker threads, and the handler it runs at fork() joins them: a node forks hivemind's
# processes (the DHT, the averagers) from a process whose threads use numpy, and that join has hung a fork()
# forever (seen in the test suite, with in-process nodes). The node's numpy work is small (packets, cosines);
# torch does the model's.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
