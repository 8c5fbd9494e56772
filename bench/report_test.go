package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestHaltPoll(t *testing.T) {
	root := t.TempDir()
	put := func(path, content string) {
		t.Helper()
		full := filepath.Join(root, path)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got := haltPoll(root); got != "" {
		t.Fatalf("no sysfs: haltPoll = %q, want empty", got)
	}
	put("sys/devices/system/cpu/cpuidle/current_driver", "acpi_idle\n")
	put("sys/module/haltpoll/parameters/guest_halt_poll_ns", "0\n")
	if got := haltPoll(root); got != "" {
		t.Fatalf("another cpuidle driver: haltPoll = %q, want empty", got)
	}
	put("sys/devices/system/cpu/cpuidle/current_driver", "haltpoll\n")
	if err := os.Remove(filepath.Join(root, "sys/module/haltpoll/parameters/guest_halt_poll_ns")); err != nil {
		t.Fatal(err)
	}
	if got := haltPoll(root); got != "" {
		t.Fatalf("haltpoll driver without its parameter: haltPoll = %q, want empty", got)
	}
	put("sys/module/haltpoll/parameters/guest_halt_poll_ns", "0\n")
	if got, want := haltPoll(root), "; guest halt polling off (haltpoll guest_halt_poll_ns=0): an idle CPU halts at once"; got != want {
		t.Fatalf("off: haltPoll = %q, want %q", got, want)
	}
	put("sys/module/haltpoll/parameters/guest_halt_poll_ns", "200000\n")
	if got, want := haltPoll(root), "; guest halt polling up to 200000 ns (haltpoll guest_halt_poll_ns)"; got != want {
		t.Fatalf("on: haltPoll = %q, want %q", got, want)
	}
}
