package bpf

import (
	"fmt"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// The floor of a flow table's map work (issue 28, a lean new flow): programs that do nothing but
// the map operations any design with two hash entries per flow (one per direction, so that each
// packet is one lookup) must make, measured as the datapath's programs are (measure), on tables
// of the kinds and sizes the datapath loads (benchHarness's NATEntries). Beside
// BenchmarkTestRunFloor, they tell what a new flow and an established packet cannot cost less
// than on this kernel: BenchmarkFloorNewFlow a lookup that misses and the flow's two inserts of
// fresh keys, BenchmarkFloorEstablished a lookup that hits and a write of its value in place,
// BenchmarkFloorFlowLife a short connection's eight packets in the current design and in one
// with a single table for both states.

// The Ethernet and IPv4 offsets of the tuple the floor programs build their keys from: the
// source and destination addresses and the ports, in the order of nat4_key (bpf/types.h).
const (
	floorTupleOff = 14 + 12 // IPv4 source address
	floorTupleEnd = 14 + 20 + 4
)

// floorKey writes at fp+off the nat4_key of the packet's tuple (r2: skb->data, checked to hold
// floorTupleEnd bytes) with direction dir; r5 is clobbered.
func floorKey(off int16, dir int32) asm.Instructions {
	return asm.Instructions{
		asm.LoadMem(asm.R5, asm.R2, floorTupleOff, asm.Word),
		asm.StoreMem(asm.RFP, off, asm.R5, asm.Word),
		asm.LoadMem(asm.R5, asm.R2, floorTupleOff+4, asm.Word),
		asm.StoreMem(asm.RFP, off+4, asm.R5, asm.Word),
		asm.LoadMem(asm.R5, asm.R2, floorTupleOff+8, asm.Word),
		asm.StoreMem(asm.RFP, off+8, asm.R5, asm.Word),
		asm.StoreImm(asm.RFP, off+12, int64(6|dir<<8), asm.Word), // proto TCP, dir, pad
	}
}

// Stack slots of the floor programs: the two halves' keys and a value (a nat_entry, zeroed).
const (
	floorKey0  = -16
	floorKey1  = -32
	floorValue = -80
)

// floorProgram is a SchedCLS program that builds both halves' keys of the packet's tuple (as the
// datapath's nat_key does), runs body, and returns TC_NEXT. body finds the keys and the value on
// the stack (floorKey0, floorKey1, floorValue) and keeps r6 (the context).
func floorProgram(tb testing.TB, body asm.Instructions) *ebpf.Program {
	tb.Helper()
	insns := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R6, 76, asm.Word), // skb->data
		asm.LoadMem(asm.R3, asm.R6, 80, asm.Word), // skb->data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, floorTupleEnd),
		asm.JGT.Reg(asm.R4, asm.R3, "out"),
	}
	insns = append(insns, floorKey(floorKey0, 0)...) // DIR_EGRESS
	insns = append(insns, floorKey(floorKey1, 1)...) // DIR_INGRESS
	insns = append(insns, asm.Mov.Imm(asm.R5, 0))
	for off := int16(floorValue); off < floorKey1; off += 8 {
		insns = append(insns, asm.StoreMem(asm.RFP, off, asm.R5, asm.DWord))
	}
	insns = append(insns, body...)
	insns = append(insns, asm.Mov.Imm(asm.R0, -1).WithSymbol("out"), asm.Return())
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "Dual BSD/GPL", Instructions: insns})
	if err != nil {
		tb.Fatalf("floor program: %v", err)
	}
	tb.Cleanup(func() { prog.Close() })
	return prog
}

// floorMapOp calls helper fn on m with the key at fp+key (and, for an update, the value with
// flags).
func floorMapOp(m *ebpf.Map, fn asm.BuiltinFunc, key int16, flags int32) asm.Instructions {
	insns := asm.Instructions{
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, int32(key)),
	}
	if fn == asm.FnMapUpdateElem {
		insns = append(insns, asm.Mov.Reg(asm.R3, asm.RFP), asm.Add.Imm(asm.R3, floorValue), asm.Mov.Imm(asm.R4, flags))
	}
	return append(insns, fn.Call())
}

// floorMap is a table like the datapath's one of kind typ (nat_v4: a preallocated hash, nat_new_v4:
// an LRU hash) with entries of theirs.
func floorMap(tb testing.TB, typ ebpf.MapType, entries uint32) *ebpf.Map {
	tb.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: typ, KeySize: 16, ValueSize: 48, MaxEntries: entries})
	if err != nil {
		tb.Fatalf("floor map: %v", err)
	}
	tb.Cleanup(func() { m.Close() })
	return m
}

// floorTables are the table kinds a flow's new entries can go into: the unreplied table's (an
// LRU hash, nat_new_v4's size) and a preallocated hash of the same size (nat_v4's kind).
var floorTables = []struct {
	name string
	typ  ebpf.MapType
}{{"lru", ebpf.LRUHash}, {"prealloc", ebpf.Hash}}

// floorFlow is the n-th tuple of BenchmarkEgressNewFlow's sequence (each a new flow).
func floorFlow(n int) []byte {
	return tcpPacket(ap(pod4(n>>14), uint16(1024+n&0x3fff)), ap(remoteN(n), 443), tcpSYN, nil)
}

// BenchmarkFloorNewFlow: a lookup of the packet's egress key that misses, then the inserts of
// both halves' keys (BPF_NOEXIST), each run a new tuple.
func BenchmarkFloorNewFlow(b *testing.B) {
	for _, t := range floorTables {
		b.Run(t.name, func(b *testing.B) {
			h := benchHarness(b, 1)
			m := floorMap(b, t.typ, unrepliedEntries(h.dp.objs.NatV4.MaxEntries()))
			var body asm.Instructions
			body = append(body, floorMapOp(m, asm.FnMapLookupElem, floorKey0, 0)...)
			body = append(body, floorMapOp(m, asm.FnMapUpdateElem, floorKey1, int32(ebpf.UpdateNoExist))...)
			body = append(body, floorMapOp(m, asm.FnMapUpdateElem, floorKey0, int32(ebpf.UpdateNoExist))...)
			prog := floorProgram(b, body)
			next := 0 // runs never repeat a tuple, across b.N's rounds too
			measure(b, h, prog, tcNext, func(int) []byte { next++; return floorFlow(next) })
			if n, _ := floorCount(m); n < b.N {
				b.Fatalf("%d entries after %d new flows: the inserts failed", n, b.N)
			}
		})
	}
}

// BenchmarkFloorEstablished: a lookup of the packet's egress key that hits, in the confirmed
// table's kind and size, and a write of the value in place (the TCP state an established packet
// records).
func BenchmarkFloorEstablished(b *testing.B) {
	h := benchHarness(b, 1)
	m := floorMap(b, ebpf.Hash, h.dp.objs.NatV4.MaxEntries())
	frame := tcpPacket(ap(pod4(1), 40000), ap(remote4, 443), tcpACK, make([]byte, 64))
	body := floorMapOp(m, asm.FnMapLookupElem, floorKey0, 0)
	body = append(body,
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.LoadMem(asm.R1, asm.R6, 0, asm.Word),   // skb->len
		asm.StoreMem(asm.R0, 28, asm.R1, asm.Word), // ack
		asm.StoreMem(asm.R0, 32, asm.R1, asm.Word), // end
	)
	prog := floorProgram(b, body)
	var key natKey4
	copy(key[:12], frame[floorTupleOff:floorTupleEnd])
	key[12] = 6
	if err := m.Put(key[:], make([]byte, 48)); err != nil {
		b.Fatal(err)
	}
	measure(b, h, prog, tcNext, func(int) []byte { return frame })
	var v [48]byte
	if err := m.Lookup(key[:], v[:]); err != nil || v[28] == 0 {
		b.Fatalf("the established entry was not written (%v)", err)
	}
}

// floorHit looks the key at fp+key up in m and writes the TCP state of the packet into the value
// found (an established packet's map work).
func floorHit(m *ebpf.Map, key int16, label string) asm.Instructions {
	return append(floorMapOp(m, asm.FnMapLookupElem, key, 0),
		asm.JEq.Imm(asm.R0, 0, label),
		asm.LoadMem(asm.R1, asm.R6, 0, asm.Word),   // skb->len
		asm.StoreMem(asm.R0, 28, asm.R1, asm.Word), // ack
		asm.StoreMem(asm.R0, 32, asm.R1, asm.Word), // end
		asm.Mov.Imm(asm.R0, 0).WithSymbol(label),
	)
}

// BenchmarkFloorFlowLife: BenchmarkConnection's eight packets as map work alone, one program per
// packet, each connection a new tuple. two-tables: the current design's (bpf/nat.h), the new flow's
// halves inserted into the unreplied table (an LRU hash), the first reply's found there, the
// handshake's ACK moving both to the confirmed table (two lookups, two inserts, two deletes), the
// rest found there. one-table: both halves inserted once into a table for both states (a
// preallocated hash of the confirmed table's size), every later packet a lookup that hits.
func BenchmarkFloorFlowLife(b *testing.B) {
	type step struct {
		name string
		prog *ebpf.Program
	}
	for _, design := range []string{"two-tables", "one-table"} {
		b.Run(design, func(b *testing.B) {
			h := benchHarness(b, 1)
			confirmed := floorMap(b, ebpf.Hash, h.dp.objs.NatV4.MaxEntries())
			opened := confirmed
			if design == "two-tables" {
				opened = floorMap(b, ebpf.LRUHash, unrepliedEntries(h.dp.objs.NatV4.MaxEntries()))
			}
			var syn asm.Instructions
			syn = append(syn, floorMapOp(opened, asm.FnMapLookupElem, floorKey0, 0)...)
			syn = append(syn, floorMapOp(opened, asm.FnMapUpdateElem, floorKey1, int32(ebpf.UpdateNoExist))...)
			syn = append(syn, floorMapOp(opened, asm.FnMapUpdateElem, floorKey0, int32(ebpf.UpdateNoExist))...)
			ack := floorHit(confirmed, floorKey0, "hit")
			if design == "two-tables" {
				ack = floorHit(opened, floorKey0, "hit0")
				ack = append(ack, floorMapOp(opened, asm.FnMapLookupElem, floorKey1, 0)...)
				for _, k := range []int16{floorKey0, floorKey1} {
					ack = append(ack, floorMapOp(confirmed, asm.FnMapUpdateElem, k, int32(ebpf.UpdateNoExist))...)
				}
				for _, k := range []int16{floorKey0, floorKey1} {
					ack = append(ack, floorMapOp(opened, asm.FnMapDeleteElem, k, 0)...)
				}
			}
			egress, ingress := floorProgram(b, floorHit(confirmed, floorKey0, "hit")), floorProgram(b, floorHit(confirmed, floorKey1, "hit"))
			steps := []step{
				{"syn", floorProgram(b, syn)}, {"synack", floorProgram(b, floorHit(opened, floorKey1, "hit"))},
				{"ack", floorProgram(b, ack)}, {"request", egress}, {"response", ingress},
				{"server-fin", ingress}, {"pod-fin", egress}, {"last-ack", ingress},
			}
			total := make([]time.Duration, len(steps))
			next := 0
			var err error
			b.ResetTimer()
			h.ns.do(func() {
				for i := 0; i < b.N && err == nil; i++ {
					next++
					frame := floorFlow(next)
					for j, st := range steps {
						ret, d, rerr := benchRun(st.prog, frame)
						if rerr == nil && ret != tcNext {
							rerr = fmt.Errorf("%s: verdict %d, want %d", st.name, ret, tcNext)
						}
						if rerr != nil {
							err = rerr
							break
						}
						total[j] += d
					}
				}
			})
			if err != nil {
				b.Fatal(err)
			}
			if n, _ := floorCount(confirmed); n != 2*b.N {
				b.Fatalf("%d flow entries after %d connections, want %d", n, b.N, 2*b.N)
			}
			var sum time.Duration
			for j, st := range steps {
				b.ReportMetric(float64(total[j].Nanoseconds())/float64(b.N), st.name+"-ns")
				sum += total[j]
			}
			b.ReportMetric(float64(sum.Nanoseconds())/float64(b.N), "ns/conn")
		})
	}
}

// natKey4 is a nat4_key's bytes.
type natKey4 [16]byte

// floorCount is the number of entries in m.
func floorCount(m *ebpf.Map) (int, error) {
	var (
		k, v [64]byte
		n    int
	)
	it := m.Iterate()
	for it.Next(k[:m.KeySize()], v[:m.ValueSize()]) {
		n++
	}
	return n, it.Err()
}
