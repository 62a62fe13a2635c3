import sys

from flame.train.trainer import main

sys.exit(main())
