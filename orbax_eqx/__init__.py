"""Checkpoint Equinox modules through Orbax, leaf by leaf, with nothing lost."""

from ._errors import CheckpointDamagedError as CheckpointDamagedError
from ._errors import CheckpointMismatchError as CheckpointMismatchError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CheckpointPermissionError as CheckpointPermissionError
from ._errors import HostLocalArrayError as HostLocalArrayError
from ._errors import ObjectStoreError as ObjectStoreError
from ._errors import ObjectStoreSaveError as ObjectStoreSaveError
from ._errors import OrbaxEqxError as OrbaxEqxError
from ._errors import RebuildError as RebuildError
from ._errors import ShardingRuleError as ShardingRuleError
from ._errors import SidecarError as SidecarError
from ._errors import UnsupportedLeafError as UnsupportedLeafError
from ._format.sidecar import LeafMetadata as LeafMetadata
from ._format.sidecar import Metadata as Metadata
from ._orbax.api import CheckpointExistsError as CheckpointExistsError
from ._orbax.api import NotACheckpointError as NotACheckpointError
from ._orbax.api import NotWritableError as NotWritableError
from ._orbax.api import metadata as metadata
from ._orbax.api import restore as restore
from ._orbax.api import save as save
from ._orbax.handler import EqxHandler as EqxHandler
from ._orbax.handler import EqxRestore as EqxRestore
from ._orbax.handler import EqxSave as EqxSave
from ._orbax.type_handler import PackedArrayHandler as PackedArrayHandler
from ._orbax.type_registry import type_handler_registry as type_handler_registry
from ._orbax.v1 import EqxCheckpointableHandler as EqxCheckpointableHandler
from ._restore.check import StaticMismatchWarning as StaticMismatchWarning
from ._restore.fallback import FallbackWarning as FallbackWarning
from ._restore.fallback import RestoredStep as RestoredStep
from ._restore.fallback import restore_latest as restore_latest
from ._restore.rename_map import RenameError as RenameError
from ._restore.restore import RecordedLeaf as RecordedLeaf
from ._restore.rules import shardings_from_rules as shardings_from_rules
from ._restore.select import KeptLeavesWarning as KeptLeavesWarning
from ._restore.select import RestoreReport as RestoreReport
from ._restore.vanished import CheckpointDeletedError as CheckpointDeletedError
from ._restore.vanished import CheckpointReplacedError as CheckpointReplacedError
from ._save.claim import ConcurrentSaveError as ConcurrentSaveError
from ._storage.staging import StagingError as StagingError
from ._tools.verify import DamagedLeaf as DamagedLeaf
from ._tools.verify import VerifyReport as VerifyReport
from ._tools.verify import verify as verify

__version__ = "0.1.0"
