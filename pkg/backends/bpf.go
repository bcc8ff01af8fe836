package backends

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// bpfBackend is the BPF datapath: tc programs on the uplinks, maps pinned under --bpffs.
var bpfBackend = Backend{
	Name:     bpfbackend.Name,
	Title:    "BPF",
	AutoWhen: "when the kernel supports it",
	New: func(ctx context.Context, o Options) (datapath.Backend, error) {
		return bpfbackend.New(ctx, bpfbackend.Options{BPFFS: o.BPFFS, Interfaces: o.Interfaces,
			EnableIPv6: o.EnableIPv6, AttachMode: o.AttachMode, SweepInterval: o.SweepInterval,
			Timeouts: o.Timeouts, Load: bpf.LoadOptions{NATEntries: o.NATEntries}, Logger: o.Logger})
	},
	Cleanup: func(ctx context.Context, o Options) (string, error) {
		removed, err := bpfbackend.Cleanup(ctx, o.BPFFS, o.Logger)
		if err != nil {
			return "", err
		}
		report := fmt.Sprintf("%d program attachments removed (tcx links and tc filters on every device)", len(removed.Attachments))
		if removed.BPFDenied != nil {
			report += fmt.Sprintf(", %d tcx link pins removed, which detaches (shortly after) each link that no process holds open, unchecked: %v;",
				removed.UnpinnedLinks, removed.BPFDenied)
		}
		if removed.PinDir != "" {
			return report + fmt.Sprintf(", pins under %s removed", removed.PinDir), nil
		}
		return report + fmt.Sprintf(", nothing pinned under %s", filepath.Join(o.BPFFS, bpfbackend.PinDir)), nil
	},
	Read: func(_ context.Context, o Options, p *policy.Policy) ([]datapath.Reader, error) {
		// Opens the pinned maps read-only: no program loaded, no map created.
		r, err := bpfbackend.OpenReader(o.BPFFS, o.Interfaces, p)
		if err != nil || r == nil {
			return nil, err
		}
		return []datapath.Reader{r}, nil
	},
	Absent: func(o Options) string {
		return "nothing pinned under " + filepath.Join(o.BPFFS, bpfbackend.PinDir)
	},
}
