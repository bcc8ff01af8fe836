package nftables

import (
	"context"
	"fmt"

	gnft "github.com/google/nftables"
	"github.com/mdlayher/netlink"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The writer of NetlinkKernel: the element batches.

// maxElementsMessage bounds the elements' bytes in one netlink message: the kernel takes them in
// one nested attribute, whose length is 16 bits.
const maxElementsMessage = 60000

// elementBytes is an upper bound of what an element takes in a message: its key and comment
// with their attribute headers and padding.
func elementBytes(e gnft.SetElement) int { return 48 + len(e.Key) + len(e.Comment) }

// inMessages passes elems to send in runs that each fit a message.
func inMessages(elems []gnft.SetElement, send func([]gnft.SetElement) error) error {
	start, bytes := 0, 0
	for i, e := range elems {
		if bytes+elementBytes(e) > maxElementsMessage && i > start {
			if err := send(elems[start:i]); err != nil {
				return err
			}
			start, bytes = i, 0
		}
		bytes += elementBytes(e)
	}
	if start < len(elems) {
		return send(elems[start:])
	}
	return nil
}

// ChangeElements implements Kernel: one netlink batch (nfnetlink's BATCH_BEGIN ... BATCH_END,
// the kernel's transaction) of element messages, each set's split to fit a message. Elements get
// their set's counter from the kernel, which gives every element added without expressions a
// copy of its set's.
func (NetlinkKernel) ChangeElements(ctx context.Context, fam policy.Family, changes []SetChange) error {
	size := 0
	dels, adds := make([][]gnft.SetElement, len(changes)), make([][]gnft.SetElement, len(changes))
	for i, ch := range changes {
		for _, k := range ch.Delete {
			dels[i] = append(dels[i], gnft.SetElement{Key: k.AsSlice()})
			size += elementBytes(dels[i][len(dels[i])-1])
		}
		for _, e := range ch.Add {
			adds[i] = append(adds[i], gnft.SetElement{Key: e.Key.AsSlice(), Comment: e.Comment})
			size += elementBytes(adds[i][len(adds[i])-1])
		}
	}
	// The whole batch goes in one sendmsg, which the socket's send buffer must hold; the
	// answers are an acknowledgement per message, without the message (CapAcknowledge).
	c, err := gnft.New(gnft.WithSockOptions(func(c *netlink.Conn) error {
		if err := c.SetOption(netlink.CapAcknowledge, true); err != nil {
			return err
		}
		if err := c.SetWriteBuffer(2*size + 1<<20); err != nil {
			return err
		}
		return c.SetDeadline(deadline(ctx))
	}))
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	table := &gnft.Table{Name: TableName, Family: tableFamily(fam)}
	for i, ch := range changes {
		set := &gnft.Set{Table: table, Name: ch.Set}
		if ch.Flush {
			c.FlushSet(set)
		}
		del := func(e []gnft.SetElement) error { return c.SetDeleteElements(set, e) }
		add := func(e []gnft.SetElement) error { return c.SetAddElements(set, e) }
		if err := inMessages(dels[i], del); err != nil {
			return err
		}
		if err := inMessages(adds[i], add); err != nil {
			return err
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("change the elements of %s %s: %w", nftFamily(fam), TableName, err)
	}
	return nil
}
