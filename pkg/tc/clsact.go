package tc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/rtnl"
)

// clsact attaches cls_bpf filters (direct-action) under a clsact qdisc. A filter is ours when it
// sits at our priority and handle and carries our name; "tc filter replace" on that priority
// and handle swaps the program atomically. Filters outlive the process by nature.
type clsact struct {
	opts Options
	log  *slog.Logger

	mu sync.Mutex
	nl *netlink.Handle
}

func newClsact(opts Options) (*clsact, error) {
	h, err := rtnl.Handle()
	if err != nil {
		return nil, err
	}
	return &clsact{opts: opts, log: opts.logger(), nl: h}, nil
}

func (c *clsact) Mode() string { return ModeTC }

func parent(d Direction) uint32 {
	if d == Ingress {
		return netlink.HANDLE_MIN_INGRESS
	}
	return netlink.HANDLE_MIN_EGRESS
}

func (c *clsact) filterName(prog *ebpf.Program) string {
	name := "prog"
	if info, err := prog.Info(); err == nil && info.Name != "" {
		name = info.Name
	}
	return c.opts.FilterName + ":" + name
}

// ours tells our filter from others'.
func (c *clsact) ours(f netlink.Filter) (*netlink.BpfFilter, bool) {
	bf, ok := f.(*netlink.BpfFilter)
	if !ok {
		return nil, false
	}
	a := bf.Attrs()
	return bf, a.Priority == c.opts.FilterPriority && a.Handle == c.opts.FilterHandle &&
		strings.HasPrefix(bf.Name, c.opts.FilterName+":")
}

// filters lists a device's filters at a direction; a device without clsact has none.
func (c *clsact) filters(ifindex int, dir Direction) ([]netlink.Filter, error) {
	lnk, err := c.nl.LinkByIndex(ifindex)
	if err != nil {
		return nil, err
	}
	fs, err := c.nl.FilterList(lnk, parent(dir))
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil, nil // no clsact qdisc
	}
	return fs, err
}

// isNoDevice tells an error of a device that does not exist (any more).
func isNoDevice(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV)
}

func (c *clsact) ensureQdisc(ifindex int) error {
	q := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
		QdiscType:  "clsact",
	}
	// Added only when missing: replacing it would drop the filters others have there.
	if err := c.nl.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add clsact qdisc to ifindex %d: %w", ifindex, err)
	}
	return nil
}

func (c *clsact) Attach(ctx context.Context, ifindex int, dir Direction, prog *ebpf.Program) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	want, err := progID(prog)
	if err != nil {
		return err
	}
	if err := c.ensureQdisc(ifindex); err != nil {
		return err
	}
	fs, err := c.filters(ifindex, dir)
	if err != nil {
		return fmt.Errorf("list tc filters of ifindex %d %s: %w", ifindex, dir, err)
	}
	replace := false
	for _, f := range fs {
		bf, ok := c.ours(f)
		a := f.Attrs()
		if !ok && a.Priority == c.opts.FilterPriority && a.Handle == c.opts.FilterHandle {
			return fmt.Errorf("ifindex %d %s: priority %d handle %#x is taken by a filter that is not ours (%s)",
				ifindex, dir, a.Priority, a.Handle, f.Type())
		}
		if ok {
			if ebpf.ProgramID(bf.Id) == want {
				return nil
			}
			replace = true
		}
	}
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex, Parent: parent(dir), Handle: c.opts.FilterHandle,
			Priority: c.opts.FilterPriority, Protocol: unix.ETH_P_ALL},
		Fd: prog.FD(), Name: c.filterName(prog), DirectAction: true,
	}
	if err := c.nl.FilterReplace(f); err != nil {
		return fmt.Errorf("attach tc filter to ifindex %d %s: %w", ifindex, dir, err)
	}
	if replace {
		c.log.Info("program replaced in place", "mode", ModeTC, "ifindex", ifindex, "direction", dir.String())
	} else {
		c.log.Info("attached", "mode", ModeTC, "ifindex", ifindex, "direction", dir.String())
	}
	return nil
}

// Runs implements Hook: our filter at dir carries prog.
func (c *clsact) Runs(ctx context.Context, ifindex int, dir Direction, prog *ebpf.Program) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	want, err := progID(prog)
	if err != nil {
		return false, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	fs, err := c.filters(ifindex, dir)
	if isNoDevice(err) {
		return false, fmt.Errorf("ifindex %d: %w (%v)", ifindex, ErrNoDevice, err)
	}
	if err != nil {
		return false, fmt.Errorf("list tc filters of ifindex %d %s: %w", ifindex, dir, err)
	}
	for _, f := range fs {
		if bf, ok := c.ours(f); ok && ebpf.ProgramID(bf.Id) == want {
			return true, nil
		}
	}
	return false, nil
}

func (c *clsact) Detach(ctx context.Context, ifindex int, dir Direction) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	fs, err := c.filters(ifindex, dir)
	if isNoDevice(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list tc filters of ifindex %d %s: %w", ifindex, dir, err)
	}
	removed := false
	for _, f := range fs {
		if _, ok := c.ours(f); !ok {
			continue
		}
		if err := c.nl.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("delete tc filter of ifindex %d %s: %w", ifindex, dir, err)
		}
		removed = true
		c.log.Info("detached", "mode", ModeTC, "ifindex", ifindex, "direction", dir.String())
	}
	if !removed {
		return nil // an empty clsact qdisc we did not just empty may be another component's
	}
	return c.dropEmptyQdisc(ifindex)
}

// dropEmptyQdisc removes a clsact qdisc left without filters by our detach: it does nothing
// then, and leaving it would be the one trace of the agent on the device. A qdisc with others'
// filters stays.
func (c *clsact) dropEmptyQdisc(ifindex int) error {
	for _, d := range Directions() {
		fs, err := c.filters(ifindex, d)
		if err != nil || len(fs) > 0 {
			return nil
		}
	}
	lnk, err := c.nl.LinkByIndex(ifindex)
	if err != nil {
		return nil
	}
	qs, err := c.nl.QdiscList(lnk)
	if err != nil {
		return fmt.Errorf("list qdiscs of ifindex %d: %w", ifindex, err)
	}
	for _, q := range qs {
		if q.Type() == "clsact" {
			if err := c.nl.QdiscDel(q); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
				return fmt.Errorf("delete empty clsact qdisc of ifindex %d: %w", ifindex, err)
			}
		}
	}
	return nil
}

func (c *clsact) List(ctx context.Context) ([]Attachment, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	links, err := c.nl.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list devices: %w", err)
	}
	var out []Attachment
	for _, l := range links {
		for _, d := range Directions() {
			fs, err := c.filters(l.Attrs().Index, d)
			if isNoDevice(err) {
				break // the device went away meanwhile (pods come and go)
			}
			if err != nil {
				return nil, fmt.Errorf("list tc filters of %s %s: %w", l.Attrs().Name, d, err)
			}
			for _, f := range fs {
				if bf, ok := c.ours(f); ok {
					out = append(out, Attachment{Mode: ModeTC, Ifindex: l.Attrs().Index, Dir: d, Program: ebpf.ProgramID(bf.Id)})
				}
			}
		}
	}
	return out, nil
}

func (c *clsact) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.nl.Close()
	return nil
}
