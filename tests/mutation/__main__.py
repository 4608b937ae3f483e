import sys

from tests.mutation.mutate import main

sys.exit(main())
