package bpfbackend

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/sandbox"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// Removed says what Cleanup removed.
type Removed struct {
	// Attachments are our programs it detached, of either mode.
	Attachments []tc.Attachment
	// PinDir is the pin directory it removed, empty when there was none.
	PinDir string
	// BPFDenied says why bpf(2) was refused (a seccomp filter, see sandbox.BPFDenied); nil
	// when it worked. Without it tcx links can be neither listed nor detached, and only
	// their pins are removed.
	BPFDenied error
	// UnpinnedLinks counts the tcx link pins removed while bpf(2) was refused: the kernel
	// detaches each such link with its last reference, unless a process still holds it.
	UnpinnedLinks int
}

// Cleanup removes everything the BPF backend installs, whatever process installed it and with
// whatever flags: our programs on every device of the network namespace (tcx links, pinned under
// bpffs or anywhere else, and clsact filters), then the pins under <bpffs>/ip-masq-agent/
// (maps, and with them their counters and flows). Traffic keeps flowing, untranslated from then
// on. Absent state is not an error; running it twice is fine. Pins are touched only when bpffs is
// a BPF filesystem.
func Cleanup(ctx context.Context, bpffs string, log *slog.Logger) (Removed, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var res Removed
	pinDir := filepath.Join(bpffs, PinDir)
	// Refused bpf(2) looks like a kernel without tcx to the library, so the links would go
	// uncounted: count their pins, which is all that can be removed then.
	if res.BPFDenied = sandbox.BPFDenied(); res.BPFDenied != nil {
		pins, err := os.ReadDir(filepath.Join(pinDir, LinkDir))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return res, fmt.Errorf("read link pins: %w", err)
		}
		res.UnpinnedLinks = len(pins)
	}
	removed, err := tc.RemoveAll(ctx, tcOptions(pinDir, log))
	log = log.With("component", "bpf")
	res.Attachments = removed
	if err != nil {
		return res, fmt.Errorf("remove BPF programs: %w", err)
	}
	if removed, err := bpf.RemovePinned(pinDir); err != nil || !removed {
		return res, err
	}
	res.PinDir = pinDir
	if res.BPFDenied != nil {
		log.Warn("bpf(2) is refused: tcx links were removed only through their pins, unchecked", "linkPins", res.UnpinnedLinks, "reason", res.BPFDenied)
	}
	log.Info("BPF datapath removed", "attachments", len(removed), "linkPins", res.UnpinnedLinks, "pins", pinDir)
	return res, nil
}
