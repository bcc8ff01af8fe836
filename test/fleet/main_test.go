package fleet

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// agentBin is the agent binary under test, built once by TestMain (or given as
// $IP_MASQ_AGENT_BIN); empty where the privileged tests cannot run.
var agentBin string

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	flag.Parse()
	if os.Geteuid() == 0 && (!testing.Short() || testutil.InCI()) {
		if bin := os.Getenv("IP_MASQ_AGENT_BIN"); bin != "" {
			if !filepath.IsAbs(bin) {
				fmt.Fprintf(os.Stderr, "fleet: IP_MASQ_AGENT_BIN=%s must be an absolute path\n", bin)
				return 1
			}
			agentBin = bin
		} else {
			dir, err := os.MkdirTemp("", "ip-masq-agent-fleet-")
			if err != nil {
				fmt.Fprintln(os.Stderr, "fleet:", err)
				return 1
			}
			defer os.RemoveAll(dir)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			agentBin = filepath.Join(dir, "ip-masq-agent")
			cmd := exec.CommandContext(ctx, "go", "build", "-o", agentBin, "github.com/ip-masq-agent/ip-masq-agent/cmd/ip-masq-agent")
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if b, err := cmd.CombinedOutput(); err != nil {
				fmt.Fprintf(os.Stderr, "fleet: build the agent: %v\n%s", err, b)
				return 1
			}
		}
	}
	return m.Run()
}
