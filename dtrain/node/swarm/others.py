"""What a node knows of the other peers, as its optimizer and their tracker read it (`Others`).

Two parts of the node know it: its presence (node.swarm.presence: who announced itself, at which epoch, and who
downloads) and its contact with the peers it trained with (node.swarm.contact: whose process ended, whether this node
reaches none of them). Both need the DHT, which starts with the optimizer, so they are filled in after it: until
then the node knows of no one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    from dtrain.node.swarm.contact import Contact
    from dtrain.node.swarm.presence import PeerInfo, Presence


class Others:
    """The other peers, as this node's presence and contact know them (see the module docstring)."""

    def __init__(self) -> None:
        self.presence: Optional["Presence"] = None
        self.contact: Optional["Contact"] = None

    def present(self) -> bool:
        """Another node announced itself."""
        return self.presence is not None and not self.presence.alone()

    def announced(self) -> Mapping[str, "PeerInfo"]:
        """peer id -> what each node announced (its epoch, -1 while it downloads; when)."""
        return self.presence.nodes if self.presence is not None else {}

    def ended(self) -> Mapping[str, float]:
        """peer id -> DHT time this node found the peer's process ended (node.swarm.contact.Contact.ended)."""
        return self.contact.ended() if self.contact is not None else {}

    def isolated(self) -> bool:
        """This node reaches none of the peers it trained with (node.swarm.contact.Contact.isolated)."""
        return self.contact is not None and self.contact.isolated()

    def reach_now(self) -> None:
        """After a round that gave no update: ping the peers heard from lately (node.swarm.contact.Contact.reach_now),
        so that the next round knows whether one of them ended."""
        if self.contact is not None:
            self.contact.reach_now()


class AlwaysPresent(Others):
    """A swarm without announcements (the adapter's, node.serve.adapter): others are taken to be there always."""

    def present(self) -> bool:
        return True
