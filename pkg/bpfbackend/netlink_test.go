package bpfbackend

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	ciliumlink "github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// netlinkCounter counts the netlink messages this process sends, whatever library sends them: a
// program on the raw sys_enter tracepoint counts the sendto and sendmsg calls of this process's
// thread group (which, in these tests, only ever sends on netlink sockets). Every netlink request
// (a get, a dump, a change) is one. A raw tracepoint needs neither kprobes nor tracefs.
type netlinkCounter struct {
	count *ebpf.Map
	probe ciliumlink.Link
}

func newNetlinkCounter(tb testing.TB) *netlinkCounter {
	tb.Helper()
	if err := rlimit.RemoveMemlock(); err != nil {
		tb.Fatal(err)
	}
	count, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { count.Close() })
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.RawTracepoint, License: "GPL", Instructions: asm.Instructions{
		// args[1] of sys_enter is the syscall number.
		asm.LoadMem(asm.R6, asm.R1, 8, asm.DWord),
		asm.JEq.Imm(asm.R6, unix.SYS_SENDTO, "mine"),
		asm.JNE.Imm(asm.R6, unix.SYS_SENDMSG, "out"),
		asm.FnGetCurrentPidTgid.Call().WithSymbol("mine"),
		asm.RSh.Imm(asm.R0, 32),
		asm.JNE.Imm(asm.R0, int32(os.Getpid()), "out"),
		asm.StoreImm(asm.RFP, -4, 0, asm.Word),
		asm.LoadMapPtr(asm.R1, count.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.Mov.Imm(asm.R1, 1),
		asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, 0).WithSymbol("out"),
		asm.Return(),
	}})
	if err != nil {
		tb.Fatal(err)
	}
	defer prog.Close()
	probe, err := ciliumlink.AttachRawTracepoint(ciliumlink.RawTracepointOptions{Name: "sys_enter", Program: prog})
	if err != nil {
		testutil.Unavailable(tb, "raw tracepoint sys_enter: %v", err)
	}
	tb.Cleanup(func() { probe.Close() })
	return &netlinkCounter{count: count, probe: probe}
}

// sent is how many netlink messages the process has sent since the counter started.
func (c *netlinkCounter) sent(tb testing.TB) uint64 {
	tb.Helper()
	var n uint64
	if err := c.count.Lookup(uint32(0), &n); err != nil {
		tb.Fatal(err)
	}
	return n
}

// uplinkNode makes n uplinks (veths named up0, up1, ... with an IPv4 and an IPv6 address, their
// peers left in the namespace) in the namespace of the calling thread.
func uplinkNode(tb testing.TB, n int) []string {
	tb.Helper()
	var names []string
	for i := range n {
		name := fmt.Sprintf("up%d", i)
		l := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: fmt.Sprintf("peer%d", i)}
		if err := netlink.LinkAdd(l); err != nil {
			tb.Fatal(err)
		}
		for _, a := range []string{fmt.Sprintf("192.0.2.%d/24", i+1), fmt.Sprintf("2001:db8::%d/64", i+1)} {
			addr, err := netlink.ParseAddr(a)
			if err != nil {
				tb.Fatal(err)
			}
			if err := netlink.AddrAdd(l, addr); err != nil && !errors.Is(err, os.ErrExist) {
				tb.Fatal(err)
			}
		}
		if err := netlink.LinkSetUp(l); err != nil {
			tb.Fatal(err)
		}
		names = append(names, name)
	}
	return names
}

// applyRequests starts a backend on n uplinks in a namespace of its own, applies the defaults
// once, and returns the fewest netlink messages one of several further applies of the same
// policy sent (the fewest: the uplink watcher's first reading may fall into one of them).
func applyRequests(t *testing.T, c *netlinkCounter, mode string, n int) uint64 {
	t.Helper()
	bpffs := testutil.MountBPFFS(t)
	var fewest uint64
	inNetns(t, func() {
		ctx := context.Background()
		b, err := New(ctx, Options{BPFFS: bpffs, Interfaces: uplinkNode(t, n), AttachMode: mode})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		p := compile(t, "", true)
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		var counts []uint64
		for range 3 {
			before := c.sent(t)
			if err := b.Apply(ctx, p); err != nil {
				t.Fatal(err)
			}
			counts = append(counts, c.sent(t)-before)
		}
		fewest = slices.Min(counts)
	})
	return fewest
}

// An apply of the policy in force (a resync, a drift repair) asks netlink for the uplinks and
// their addresses, and in tcx mode nothing else: per uplink, only the lookup of its device. It
// used to list every address of the namespace twice per uplink and the uplink's tc filters
// (the other attach mode's leftovers) in each direction: seven requests per uplink in tcx mode,
// nine in tc mode.
func TestApplyNetlinkRequests(t *testing.T) {
	testutil.RequirePrivileged(t)
	c := newNetlinkCounter(t)
	// tc mode checks each uplink's filters through netlink (a device lookup and a filter dump
	// per hook), where tcx mode asks the bpf syscall.
	for _, m := range []struct {
		mode      string
		perUplink float64
	}{{tc.ModeTCX, 1}, {tc.ModeTC, 5}} {
		if m.mode == tc.ModeTCX {
			has, err := tc.HaveTCX()
			if err != nil {
				t.Fatalf("tcx probe: %v", err)
			}
			if !has {
				continue // tc mode is this kernel's only one
			}
		}
		one := applyRequests(t, c, m.mode, 1)
		three := applyRequests(t, c, m.mode, 3)
		t.Logf("%s: netlink requests per apply: %d with one uplink, %d with three", m.mode, one, three)
		if perUplink := float64(three-one) / 2; three < one || perUplink > m.perUplink {
			t.Errorf("%s: an apply sends %.1f netlink requests per uplink (%d with one, %d with three), want at most %.0f",
				m.mode, perUplink, one, three, m.perUplink)
		}
	}
}
