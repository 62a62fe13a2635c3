from flame.compat import defer_fla_package_imports
from flame.process_end import exit_without_final_collection

# Before anything imports FLA: its packages load the kernels the run calls, not every layer and model (flame/compat.py).
defer_fla_package_imports()
from flame.train.trainer import main  # noqa: E402

# A rank that raises ends through Python's own exit, which prints the traceback.
exit_without_final_collection(main())
