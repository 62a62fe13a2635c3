from flame.process_end import exit_without_final_collection
from flame.train.trainer import main

# A rank that raises ends through Python's own exit, which prints the traceback.
exit_without_final_collection(main())
