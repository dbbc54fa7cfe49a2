import sys

from pcd_integrations.commands.main import main

sys.exit(main())
