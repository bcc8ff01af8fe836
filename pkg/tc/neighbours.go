package tc

import (
	"context"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Neighbour is a program of another component on a hook where ours runs (a CNI, kube-proxy's
// replacement, a monitoring agent).
//
// Our programs return TC_ACT_UNSPEC (TCX_NEXT) on every path that neither drops nor redirects,
// so a neighbour behind ours sees every packet we let through, as rewritten. A neighbour ahead
// of ours decides whether ours runs at all: one that ends the chain (TCX_PASS, TC_ACT_OK, a
// redirect) takes the packets it passes past our program, unmasqueraded.
type Neighbour struct {
	// Mode is how it is attached: ModeTCX (a tcx link or program) or ModeTC (a tc filter).
	Mode    string
	Dir     Direction
	Program ebpf.ProgramID
	// Name is the program's name, and for a tc filter the filter's name after it.
	Name string
	// Priority is a tc filter's priority (lower runs first); 0 for tcx.
	Priority uint16
	// Ahead: it runs before ours, so its verdict decides whether ours runs.
	Ahead bool
}

// String names the neighbour as the kernel knows it: "tcx program 42 \"name\"", or for a tc
// filter with its priority.
func (n Neighbour) String() string {
	s := fmt.Sprintf("%s program %d %q", n.Mode, n.Program, n.Name)
	if n.Mode == ModeTC {
		s += fmt.Sprintf(" priority %d", n.Priority)
	}
	return s
}

// Neighbours lists the programs of others on the device's hooks (egress first, each in the
// order they run) and tells which of them run ahead of ours. Where ours is not attached (drift
// that an Apply repairs), every program is reported behind: ahead of nothing.
//
// In tcx mode ours is a tcx link; tcx programs run in their link order, and clsact filters run
// after the last tcx program that returns TCX_NEXT, so they are all behind ours. In tc mode ours
// is a clsact filter: every tcx program runs first, and so does every filter of a lower
// priority (or of ours, listed first).
func (m *Manager) Neighbours(ctx context.Context, ifindex int) ([]Neighbour, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var out []Neighbour
	for _, d := range Directions() {
		x, xOurs, err := m.tcxNeighbours(ifindex, d)
		if err != nil {
			return nil, err
		}
		f, fOurs, err := m.filterNeighbours(ifindex, d)
		if err != nil {
			return nil, err
		}
		if m.Mode() == ModeTCX {
			markAhead(x, xOurs)
		} else {
			markAhead(f, fOurs)
			if fOurs >= 0 {
				markAhead(x, len(x))
			}
		}
		out = append(append(out, x...), f...)
	}
	return out, nil
}

// markAhead marks the first n neighbours as ahead (n < 0: none).
func markAhead(ns []Neighbour, n int) {
	for i := range ns {
		ns[i].Ahead = i < n
	}
}

// tcxNeighbours lists the tcx programs of others on a hook in their order, and how many of them
// run before ours (-1 when ours is not there).
func (m *Manager) tcxNeighbours(ifindex int, d Direction) ([]Neighbour, int, error) {
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: attachType(d)})
	if errors.Is(err, unix.EINVAL) || errors.Is(err, ebpf.ErrNotSupported) {
		return nil, -1, nil // no tcx on this kernel
	}
	if errors.Is(err, unix.ENODEV) {
		return nil, -1, fmt.Errorf("ifindex %d: %w", ifindex, ErrNoDevice)
	}
	if err != nil {
		return nil, -1, fmt.Errorf("query tcx programs of ifindex %d %s: %w", ifindex, d, err)
	}
	var out []Neighbour
	ours := -1
	for _, ap := range res.Programs {
		info, ok := programInfo(ap.ID)
		if !ok {
			continue // gone meanwhile
		}
		if m.owns(info) {
			if ours < 0 {
				ours = len(out)
			}
			continue
		}
		out = append(out, Neighbour{Mode: ModeTCX, Dir: d, Program: ap.ID, Name: info.Name})
	}
	return out, ours, nil
}

// filterNeighbours lists the tc filters of others on a hook in the order they run, and how many
// of them run before ours (-1 when ours is not there).
func (m *Manager) filterNeighbours(ifindex int, d Direction) ([]Neighbour, int, error) {
	c := m.cls
	c.mu.Lock()
	fs, err := c.filters(ifindex, d)
	c.mu.Unlock()
	if isNoDevice(err) {
		return nil, -1, fmt.Errorf("ifindex %d: %w (%v)", ifindex, ErrNoDevice, err)
	}
	if err != nil {
		return nil, -1, fmt.Errorf("list tc filters of ifindex %d %s: %w", ifindex, d, err)
	}
	var out []Neighbour
	ours := -1
	for _, f := range fs {
		if _, ok := c.ours(f); ok {
			if ours < 0 {
				ours = len(out)
			}
			continue
		}
		n := Neighbour{Mode: ModeTC, Dir: d, Name: f.Type(), Priority: f.Attrs().Priority}
		if bf, ok := f.(*netlink.BpfFilter); ok {
			// The program's name, and the filter's when it says more (tc names filters after
			// the object file and section: "bpf_host.o:[from-netdev]").
			n.Program, n.Name = ebpf.ProgramID(bf.Id), bf.Name
			if info, ok := programInfo(n.Program); ok && info.Name != "" && info.Name != bf.Name {
				n.Name = info.Name + " (" + bf.Name + ")"
			}
		}
		out = append(out, n)
	}
	return out, ours, nil
}

// programInfo reads a program's info by id; false when it is gone.
func programInfo(id ebpf.ProgramID) (*ebpf.ProgramInfo, bool) {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return nil, false
	}
	defer p.Close()
	info, err := p.Info()
	return info, err == nil
}
