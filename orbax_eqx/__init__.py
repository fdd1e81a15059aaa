"""Checkpoint Equinox modules through Orbax, leaf by leaf, with nothing lost."""

from ._api import CheckpointExistsError as CheckpointExistsError
from ._api import NotWritableError as NotWritableError
from ._api import metadata as metadata
from ._api import restore as restore
from ._api import save as save
from ._check import StaticMismatchWarning as StaticMismatchWarning
from ._claim import ConcurrentSaveError as ConcurrentSaveError
from ._errors import CheckpointDamagedError as CheckpointDamagedError
from ._errors import CheckpointMismatchError as CheckpointMismatchError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CheckpointPermissionError as CheckpointPermissionError
from ._errors import HostLocalArrayError as HostLocalArrayError
from ._errors import OrbaxEqxError as OrbaxEqxError
from ._errors import ShardingRuleError as ShardingRuleError
from ._errors import SidecarError as SidecarError
from ._errors import UnsupportedLeafError as UnsupportedLeafError
from ._fallback import FallbackWarning as FallbackWarning
from ._fallback import RestoredStep as RestoredStep
from ._fallback import restore_latest as restore_latest
from ._handler import EqxHandler as EqxHandler
from ._handler import EqxRestore as EqxRestore
from ._handler import EqxSave as EqxSave
from ._rename_map import RenameError as RenameError
from ._restore import RecordedLeaf as RecordedLeaf
from ._rules import shardings_from_rules as shardings_from_rules
from ._select import KeptLeavesWarning as KeptLeavesWarning
from ._select import RestoreReport as RestoreReport
from ._sidecar import LeafMetadata as LeafMetadata
from ._sidecar import Metadata as Metadata
from ._verify import DamagedLeaf as DamagedLeaf
from ._verify import VerifyReport as VerifyReport
from ._verify import verify as verify

__version__ = "0.1.0"
