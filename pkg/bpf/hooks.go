package bpf

import (
	"fmt"
	"time"
)

// HookSlots and HookRefresh mirror bpf/maps.h: hook_seen holds a stamp per device slot
// (ifindex modulo HookSlots) and direction, refreshed at most every HookRefresh.
const (
	HookSlots   = 256
	HookRefresh = 100 * time.Millisecond
)

// HookSlot is the hook_seen slot of a device: devices with the same slot share a stamp.
func HookSlot(ifindex int) int { return ifindex % HookSlots }

// HookSeen returns when a program of ours last ran on the hook of the device (or of a device
// sharing its slot) at dir, on the clock of MonotonicNow, at most HookRefresh late; zero when
// it never ran there.
func (d *Datapath) HookSeen(ifindex int, dir Direction) (time.Duration, error) {
	var ns uint64
	key := uint32(HookSlot(ifindex)<<1) | uint32(dir)
	if err := d.objs.HookSeen.Lookup(key, &ns); err != nil {
		return 0, fmt.Errorf("read hook_seen of ifindex %d %s: %w", ifindex, dir, err)
	}
	return time.Duration(ns), nil
}
