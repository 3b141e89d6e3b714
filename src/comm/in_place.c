/* MPI_IN_PLACE as a function: rsmpi does not export it, and its value is
 * the MPI library's own (Open MPI: (void *) 1; MPICH and its derivatives:
 * (void *) -1), so it is read from the library's mpi.h at build time. */
#include <mpi.h>

void *gradsync_mpi_in_place(void) { return MPI_IN_PLACE; }
